"""NVML GPM sampling, with NVML itself faked at its boundary (CI has no GPU)."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from telemetry import gpu_counters
from telemetry.gpu_counters import start_gpu_counters


class FakeNvml:
    """The part of pynvml the sampler uses, for one Hopper GPU and one older GPU."""

    NVML_SUCCESS = 0
    NVML_GPM_METRICS_GET_VERSION = 1

    def __init__(self, values: dict[int, float], failing: frozenset[int] = frozenset()) -> None:
        self.values = values
        self.failing = failing
        self.freed = 0

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        return ["h100", "a100"][index]

    def nvmlGpmQueryDeviceSupport(self, handle: str) -> Any:
        return SimpleNamespace(isSupportedDevice=int(handle == "h100"))

    def nvmlGpmSampleAlloc(self) -> object:
        return object()

    def nvmlGpmSampleFree(self, sample: object) -> None:
        self.freed += 1

    def nvmlGpmSampleGet(self, handle: str, sample: object) -> object:
        return sample

    def c_nvmlGpmMetricsGet_t(self) -> Any:
        return SimpleNamespace(metrics=[SimpleNamespace(metricId=0, nvmlReturn=0, value=0.0) for _ in range(98)])

    def nvmlGpmMetricsGet(self, request: Any) -> Any:
        for metric in request.metrics[: request.numMetrics]:
            metric.value = self.values.get(metric.metricId, 0.0)
            metric.nvmlReturn = 999 if metric.metricId in self.failing else 0
        return request


def sample(registry: CollectorRegistry, name: str, gpu: str = "0") -> float | None:
    return registry.get_sample_value(name, {"model": "m", "gpu": gpu})


def wait_for_samples(registry: CollectorRegistry) -> None:
    """The sampler runs on its own thread; its first result lands after one interval."""
    deadline = time.monotonic() + 10
    while sample(registry, "phasescope_gpu_dram_bandwidth_utilization_ratio") is None:
        assert time.monotonic() < deadline, "no GPM sample within 10 s"
        time.sleep(0.01)


def test_supported_gpu_exports_measured_ratios() -> None:
    registry = CollectorRegistry()
    nvml = FakeNvml({10: 83.0, 5: 12.5, 2: 40.0})
    sampler = start_gpu_counters(registry, "m", interval_seconds=0.01, nvml=nvml)
    assert sampler is not None
    wait_for_samples(registry)
    sampler.close()
    assert sample(registry, "phasescope_gpu_dram_bandwidth_utilization_ratio") == 0.83
    assert sample(registry, "phasescope_gpu_tensor_active_ratio") == 0.125
    assert sample(registry, "phasescope_gpu_sm_active_ratio") == 0.40
    # The A100 (no GPM) is not sampled; samples are always freed.
    assert sample(registry, "phasescope_gpu_sm_active_ratio", gpu="1") is None
    assert nvml.freed % 2 == 0
    assert nvml.freed > 0


def test_a_metric_whose_return_code_fails_is_absent_not_zero() -> None:
    registry = CollectorRegistry()
    sampler = start_gpu_counters(registry, "m", 0.01, nvml=FakeNvml({10: 50.0, 5: 1.0, 2: 2.0}, frozenset({5})))
    assert sampler is not None
    wait_for_samples(registry)
    sampler.close()
    assert sample(registry, "phasescope_gpu_dram_bandwidth_utilization_ratio") == 0.5
    assert sample(registry, "phasescope_gpu_tensor_active_ratio") is None


def test_no_supported_gpu_means_no_series_and_no_thread() -> None:
    registry = CollectorRegistry()

    class OldGpusOnly(FakeNvml):
        def nvmlGpmQueryDeviceSupport(self, handle: str) -> Any:
            return SimpleNamespace(isSupportedDevice=0)

    assert start_gpu_counters(registry, "m", nvml=OldGpusOnly({})) is None
    assert not [m for m in registry.collect() if m.name.startswith("phasescope_gpu_")]


def test_without_nvml_nothing_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    # pynvml absent, or no driver (load_nvml gives None): nothing fails, no series. Faked at the
    # boundary, so the test says the same on a GPU machine (it used to call the real NVML).
    monkeypatch.setattr(gpu_counters, "load_nvml", lambda: None)
    registry = CollectorRegistry()
    assert start_gpu_counters(registry, "m") is None
    assert not [metric for metric in registry.collect() if metric.name.startswith("phasescope_gpu")]


def test_a_driver_that_fails_its_queries_turns_the_counters_off() -> None:
    class Broken(FakeNvml):
        def nvmlDeviceGetCount(self) -> int:
            raise RuntimeError("NVML_ERROR_DRIVER_NOT_LOADED")

    assert start_gpu_counters(CollectorRegistry(), "m", nvml=Broken({})) is None
