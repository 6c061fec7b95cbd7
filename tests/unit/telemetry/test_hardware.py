import pytest

from telemetry.hardware import DATASHEET, HardwarePeaks, lookup_device


@pytest.mark.parametrize(
    ("reported_name", "key"),
    [
        ("NVIDIA H100 80GB HBM3", "h100-sxm"),
        ("NVIDIA H100 PCIe", "h100-pcie"),
        ("NVIDIA H100 NVL", "h100-nvl"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
        ("NVIDIA L4", "l4"),
        ("NVIDIA L40S", "l40s"),
        ("NVIDIA A10G", "a10g"),
        ("NVIDIA A10", "a10"),
        ("NVIDIA B200", "b200"),
        ("AMD Instinct MI300X", "mi300x"),
        ("h100-sxm", "h100-sxm"),
    ],
)
def test_device_names_find_their_datasheet_row(reported_name: str, key: str) -> None:
    peaks = lookup_device(reported_name)
    assert peaks is not None
    assert peaks.device == key
    assert peaks.source == "datasheet"


def test_unknown_device_has_no_row() -> None:
    assert lookup_device("Intel(R) Xeon(R) Processor") is None


def test_datasheet_values_of_the_reference_devices() -> None:
    assert DATASHEET["h100-sxm"].memory_bandwidth_bytes_per_second == 3.35e12
    assert DATASHEET["h100-sxm"].peak_flops("bfloat16") == 989e12
    assert DATASHEET["h200"].memory_bandwidth_bytes_per_second == 4.8e12
    assert DATASHEET["h200"].peak_flops("bf16") == 989e12
    # No FP8 on an A100: the dtype falls back to the BF16 figure.
    assert DATASHEET["a100-80gb"].peak_flops("fp8") == 312e12


def test_flags_override_and_say_so() -> None:
    peaks = DATASHEET["l4"].with_overrides(memory_bandwidth_bytes_per_second=1e11)
    assert peaks.source == "flag"
    assert peaks.memory_bandwidth_bytes_per_second == 1e11
    assert peaks.peak_flops("bf16") == DATASHEET["l4"].peak_flops("bf16")
    assert DATASHEET["l4"].with_overrides() is DATASHEET["l4"]


def test_engines_sharing_one_device_each_get_an_equal_share_of_its_peaks() -> None:
    machine = HardwarePeaks("cpu", 30e9, {"fp32": 200e9}, "measured", "a CPU")
    each = machine.shared_by(2)
    assert each.memory_bandwidth_bytes_per_second == 15e9
    assert each.peak_flops("float32") == 100e9
    # The ridge point is the device's: sharing changes neither roof's slope.
    assert each.ridge_point_flops_per_byte("float32") == machine.ridge_point_flops_per_byte("float32")
    assert machine.shared_by(1) is machine
