import math

import pytest

from phasescope.telemetry.hardware.peaks import (
    DATASHEET,
    FAMILIES,
    HardwarePeaks,
    NoPeakFlopsError,
    dtype_family,
    lookup_device,
    names_mig_slice,
)


@pytest.mark.parametrize(
    ("reported_name", "key"),
    [
        ("NVIDIA H100 80GB HBM3", "h100-sxm"),
        ("NVIDIA H100 PCIe", "h100-pcie"),
        ("NVIDIA H100 NVL", "h100-nvl"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA H200 NVL", "h200-nvl"),
        # The 96 GB HBM3 part is named for its 480 GB of LPDDR5X; "GH200" also contains "H200".
        ("NVIDIA GH200 480GB", "gh200-96gb"),
        ("NVIDIA GH200 144G HBM3e", "gh200-144gb"),
        ("NVIDIA H20", "h20"),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
        ("NVIDIA A100 80GB PCIe", "a100-80gb-pcie"),
        ("NVIDIA A100-PCIE-80GB", "a100-80gb-pcie"),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
        ("NVIDIA A100-PCIE-40GB", "a100-40gb"),
        ("NVIDIA L4", "l4"),
        ("NVIDIA L40", "l40"),
        ("NVIDIA L40S", "l40s"),
        ("NVIDIA RTX 6000 Ada Generation", "rtx-6000-ada"),
        ("NVIDIA A10G", "a10g"),
        ("NVIDIA A10", "a10"),
        ("NVIDIA B200", "b200"),
        # "GB200" contains "B200".
        ("NVIDIA GB200", "gb200"),
        ("AMD Instinct MI300X", "mi300x"),
        ("AMD Instinct MI325X", "mi325x"),
        ("h100-sxm", "h100-sxm"),
        ("rtx-6000-ada", "rtx-6000-ada"),
    ],
)
def test_device_names_find_their_datasheet_row(reported_name: str, key: str) -> None:
    peaks = lookup_device(reported_name)
    assert peaks is not None
    assert peaks.device == key
    assert peaks.source == "datasheet"


@pytest.mark.parametrize("name", ["Intel(R) Xeon(R) Processor", "Quadro RTX 6000", "NVIDIA H800"])
def test_unknown_device_has_no_row(name: str) -> None:
    assert lookup_device(name) is None


def test_every_key_and_description_finds_its_own_row() -> None:
    for key, peaks in DATASHEET.items():
        assert lookup_device(key) is peaks
        assert lookup_device(peaks.description) is peaks, peaks.description


def test_datasheet_values_of_the_reference_devices() -> None:
    assert DATASHEET["h100-sxm"].memory_bandwidth_bytes_per_second == 3.35e12
    assert DATASHEET["h100-sxm"].peak_flops("bfloat16") == 989e12
    assert DATASHEET["h200"].memory_bandwidth_bytes_per_second == 4.8e12
    assert DATASHEET["h200"].peak_flops("bf16") == 989e12
    assert DATASHEET["gh200-144gb"].memory_bandwidth_bytes_per_second == 4.9e12
    assert DATASHEET["a100-80gb-pcie"].memory_bandwidth_bytes_per_second == 1.935e12
    assert DATASHEET["mi325x"].peak_flops("fp8") == pytest.approx(2614.9e12)


def test_fp32_is_judged_against_the_non_tensor_figure_not_bf16() -> None:
    # The bug: float32 on an H100 fell back to the BF16 tensor figure, 989 TFLOP/s instead of 67.
    h100 = DATASHEET["h100-sxm"]
    assert h100.peak_flops("float32") == 67e12
    assert h100.peak_flops("torch.float32") == 67e12
    assert h100.peak_flops("tf32") == 494.5e12


def test_every_gpu_row_has_its_own_fp32_and_tf32_figures() -> None:
    # A10G has no NVIDIA datasheet: its FP32 and TF32 are measured or flagged, never guessed.
    for key, peaks in DATASHEET.items():
        if key == "a10g":
            continue
        assert {"bf16", "fp16", "tf32", "fp32"} <= peaks.flops_per_second.keys(), key
        # Non-tensor FP32 never exceeds the tensor TF32 figure, which never exceeds BF16's.
        flops = peaks.flops_per_second
        assert flops["fp32"] <= flops["tf32"] <= flops["bf16"], key
        assert set(flops) <= set(FAMILIES), key


def test_a_family_the_device_lacks_is_refused_naming_device_dtype_and_flag() -> None:
    # No FP8 on an A100: it used to borrow the BF16 figure.
    with pytest.raises(NoPeakFlopsError) as refused:
        DATASHEET["a100-80gb"].peak_flops("fp8")
    message = str(refused.value)
    assert "NVIDIA A100 80GB" in message
    assert "fp8" in message
    assert "--peak-flops" in message
    assert isinstance(refused.value, ValueError)
    assert not DATASHEET["a100-80gb"].has_flops("float8_e4m3fn")
    # A measured peak knows only the family it measured.
    measured = HardwarePeaks("cpu", 30e9, {"fp32": 200e9}, "measured", "a CPU")
    with pytest.raises(NoPeakFlopsError):
        measured.peak_flops("bfloat16")
    with pytest.raises(NoPeakFlopsError):
        DATASHEET["a10g"].ridge_point_flops_per_byte("float32")


@pytest.mark.parametrize(
    ("dtype", "family"),
    [
        ("torch.bfloat16", "bf16"),
        ("half", "fp16"),
        ("float8_e4m3fn", "fp8"),
        ("float32", "fp32"),
        ("fp32", "fp32"),
        ("float", "fp32"),
        ("tf32", "tf32"),
    ],
)
def test_dtype_families(dtype: str, family: str) -> None:
    assert dtype_family(dtype) == family


def test_flags_override_and_say_so() -> None:
    peaks = DATASHEET["l4"].with_overrides(memory_bandwidth_bytes_per_second=1e11)
    assert peaks.source == "flag"
    assert peaks.memory_bandwidth_bytes_per_second == 1e11
    assert peaks.peak_flops("bf16") == DATASHEET["l4"].peak_flops("bf16")
    assert DATASHEET["l4"].with_overrides() is DATASHEET["l4"]


def test_a_flops_flag_sets_every_family() -> None:
    flagged = HardwarePeaks("cpu", 1e10, {"served": 1.0}, "measured").with_overrides(flops_per_second=5e12)
    for family in (*FAMILIES, "served"):
        assert flagged.flops_per_second[family] == 5e12
    assert flagged.peak_flops("tf32") == 5e12
    assert flagged.peak_flops("float8_e5m2") == 5e12


def test_engines_sharing_one_device_each_get_an_equal_share_of_its_peaks() -> None:
    machine = HardwarePeaks("cpu", 30e9, {"fp32": 200e9}, "measured", "a CPU")
    each = machine.shared_by(2)
    assert each.memory_bandwidth_bytes_per_second == 15e9
    assert each.peak_flops("float32") == 100e9
    # The ridge point is the device's: sharing changes neither roof's slope.
    assert each.ridge_point_flops_per_byte("float32") == machine.ridge_point_flops_per_byte("float32")
    assert machine.shared_by(1) is machine


@pytest.mark.parametrize(
    ("reported_name", "parent", "compute_sevenths", "memory_eighths"),
    [
        ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", "h100-sxm", 1, 1),
        ("NVIDIA H100 80GB HBM3 MIG 1g.20gb", "h100-sxm", 1, 2),
        ("NVIDIA H100 80GB HBM3 MIG 2g.20gb", "h100-sxm", 2, 2),
        ("NVIDIA H100 80GB HBM3 MIG 3g.40gb", "h100-sxm", 3, 4),
        ("NVIDIA H100 80GB HBM3 MIG 4g.40gb", "h100-sxm", 4, 4),
        ("NVIDIA H100 80GB HBM3 MIG 7g.80gb", "h100-sxm", 7, 8),
        ("NVIDIA H100 80GB HBM3 MIG 1g.10gb+me", "h100-sxm", 1, 1),
        ("NVIDIA H100 PCIe MIG 3g.40gb", "h100-pcie", 3, 4),
        ("NVIDIA H100 NVL MIG 1g.12gb", "h100-nvl", 1, 1),
        ("NVIDIA A100-SXM4-40GB MIG 1g.5gb", "a100-40gb", 1, 1),
        ("NVIDIA A100-SXM4-40GB MIG 3g.20gb", "a100-40gb", 3, 4),
        ("NVIDIA A100-SXM4-80GB MIG 7g.80gb", "a100-80gb", 7, 8),
        ("NVIDIA A100 80GB PCIe MIG 2g.20gb", "a100-80gb-pcie", 2, 2),
        # A compute instance: 1 of its GPU instance's 3 compute slices, all of the instance's memory.
        ("NVIDIA A100-SXM4-40GB MIG 1c.3g.20gb", "a100-40gb", 1, 4),
        ("NVIDIA H200 MIG 1g.18gb", "h200", 1, 1),
        ("NVIDIA H200 MIG 3g.71gb", "h200", 3, 4),
        ("NVIDIA H200 NVL MIG 7g.141gb", "h200-nvl", 7, 8),
        ("NVIDIA GH200 480GB MIG 1g.12gb", "gh200-96gb", 1, 1),
        ("NVIDIA GH200 144G HBM3e MIG 1g.18gb", "gh200-144gb", 1, 1),
        ("NVIDIA H20 MIG 2g.24gb", "h20", 2, 2),
        ("NVIDIA B200 MIG 1g.23gb", "b200", 1, 1),
        ("NVIDIA GB200 MIG 4g.93gb", "gb200", 4, 4),
        ("h100-sxm mig 3g.40gb", "h100-sxm", 3, 4),
    ],
)
def test_a_mig_slice_is_its_parents_row_scaled_by_its_share(
    reported_name: str, parent: str, compute_sevenths: int, memory_eighths: int
) -> None:
    whole = DATASHEET[parent]
    peaks = lookup_device(reported_name)
    assert peaks is not None
    assert peaks.device.startswith(f"{parent} mig ")
    assert peaks.source == "datasheet"
    assert peaks.memory_bandwidth_bytes_per_second == pytest.approx(
        whole.memory_bandwidth_bytes_per_second * memory_eighths / 8
    )
    assert peaks.flops_per_second.keys() == whole.flops_per_second.keys()
    for family, flops in whole.flops_per_second.items():
        assert peaks.flops_per_second[family] == pytest.approx(flops * compute_sevenths / 7)
    # The description says which slice and what share.
    assert f"{compute_sevenths}/7 of the compute" in peaks.description
    assert f"{memory_eighths}/8 of the memory bandwidth" in peaks.description
    # Its device key finds the same slice again (so it can be given as --hardware).
    assert lookup_device(peaks.device) == peaks


@pytest.mark.parametrize(
    "reported_name",
    [
        "NVIDIA H100 MIG",  # no profile
        "NVIDIA H100 80GB HBM3 MIG 8g.80gb",  # more than 7 compute slices
        "NVIDIA H100 80GB HBM3 MIG 0g.10gb",
        "NVIDIA A100-SXM4-40GB MIG 4c.3g.20gb",  # more compute slices than its GPU instance
        "NVIDIA H200 MIG 1g.10gb",  # a profile of another GPU: 10 GB is not a whole eighth of 141
        "NVIDIA H100 80GB HBM3 MIG 1g.200gb",
        "NVIDIA L40S MIG 1g.12gb",  # no MIG on an L40S
        "NVIDIA A30 MIG 1g.6gb",  # parent without a row
    ],
)
def test_a_mig_name_not_understood_is_unknown_never_the_whole_gpu(reported_name: str) -> None:
    assert names_mig_slice(reported_name)
    assert lookup_device(reported_name) is None


def test_mig_figures_are_finite_and_positive() -> None:
    peaks = lookup_device("NVIDIA H100 80GB HBM3 MIG 1g.10gb")
    assert peaks is not None
    assert peaks.ridge_point_flops_per_byte("bf16") == pytest.approx(
        DATASHEET["h100-sxm"].ridge_point_flops_per_byte("bf16") * 8 / 7
    )
    assert all(math.isfinite(value) and value > 0 for value in peaks.flops_per_second.values())
