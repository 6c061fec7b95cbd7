"""NVML GPM sampling, with NVML itself faked at its boundary (CI has no GPU)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from phasescope.telemetry.hardware import gpu_counters
from phasescope.telemetry.hardware.gpu_counters import GpmSampler, engine_gpus, gpm_capable, gpm_sampler

DRAM = "phasescope_gpu_dram_bandwidth_utilization_ratio"
TENSOR = "phasescope_gpu_tensor_active_ratio"
SM = "phasescope_gpu_sm_active_ratio"


@dataclass
class FakeGpu:
    uuid: str
    bus: int
    name: str = "NVIDIA H100 80GB HBM3"
    gpm: bool = True
    migs: list[tuple[str, int]] = field(default_factory=list)
    """(MIG UUID, GPU instance id) of each MIG instance; any makes the GPU be in MIG mode."""


class FakeNvmlError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value


class FakeNvml:
    """The part of pynvml the sampler uses. A GPU's handle is its UUID; a MIG instance's is its MIG UUID.

    By default one Hopper GPU and one older GPU (no GPM). Every GPM sample taken is recorded in
    `samples` as (handle, GPU instance id or None, time.monotonic()).
    """

    NVML_SUCCESS = 0
    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_ERROR_NOT_FOUND = 6
    NVML_ERROR_FUNCTION_NOT_FOUND = 13
    NVML_DEVICE_MIG_ENABLE = 1
    NVML_GPM_METRICS_GET_VERSION = 1

    def __init__(
        self,
        values: dict[int, float],
        failing: frozenset[int] = frozenset(),
        gpus: list[FakeGpu] | None = None,
        values_by_gpu: dict[str, dict[int, float]] | None = None,
    ) -> None:
        self.values = values
        self.failing = failing
        self.gpus = gpus or [FakeGpu("GPU-h100", bus=1), FakeGpu("GPU-a100", bus=2, name="NVIDIA A100", gpm=False)]
        self.values_by_gpu = values_by_gpu or {}
        self.freed = 0
        self.samples: list[tuple[str, int | None, float]] = []
        self._sampled: dict[int, str] = {}

    def _gpu(self, handle: str) -> FakeGpu:
        return next(gpu for gpu in self.gpus if gpu.uuid == handle)

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        return self.gpus[index].uuid

    def nvmlDeviceGetUUID(self, handle: str) -> str:
        return handle

    def nvmlDeviceGetName(self, handle: str) -> bytes:
        return self._gpu(handle).name.encode()

    def nvmlDeviceGetPciInfo(self, handle: str) -> Any:
        return SimpleNamespace(domain=0, bus=self._gpu(handle).bus, device=0)

    def nvmlDeviceGetMigMode(self, handle: str) -> list[int]:
        gpu = self._gpu(handle)
        if gpu.name == "NVIDIA L4":
            raise FakeNvmlError(self.NVML_ERROR_NOT_SUPPORTED)
        return [int(bool(gpu.migs)), int(bool(gpu.migs))]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: str) -> int:
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: str, index: int) -> str:
        migs = self._gpu(handle).migs
        if index >= len(migs):
            raise FakeNvmlError(self.NVML_ERROR_NOT_FOUND)
        return migs[index][0]

    def nvmlDeviceGetGpuInstanceId(self, handle: str) -> int:
        return next(instance for gpu in self.gpus for uuid, instance in gpu.migs if uuid == handle)

    def nvmlGpmQueryDeviceSupport(self, handle: str) -> Any:
        return SimpleNamespace(isSupportedDevice=int(self._gpu(handle).gpm))

    def nvmlGpmSampleAlloc(self) -> object:
        return object()

    def nvmlGpmSampleFree(self, sample: object) -> None:
        self.freed += 1

    def nvmlGpmSampleGet(self, handle: str, sample: object) -> object:
        self.samples.append((handle, None, time.monotonic()))
        self._sampled[id(sample)] = handle
        return sample

    def nvmlGpmMigSampleGet(self, handle: str, gpu_instance_id: int, sample: object) -> object:
        self.samples.append((handle, gpu_instance_id, time.monotonic()))
        self._sampled[id(sample)] = f"{handle}/{gpu_instance_id}"
        return sample

    def c_nvmlGpmMetricsGet_t(self) -> Any:
        return SimpleNamespace(metrics=[SimpleNamespace(metricId=0, nvmlReturn=0, value=0.0) for _ in range(98)])

    def nvmlGpmMetricsGet(self, request: Any) -> Any:
        values = self.values_by_gpu.get(self._sampled[id(request.sample1)], self.values)
        for metric in request.metrics[: request.numMetrics]:
            metric.value = values.get(metric.metricId, 0.0)
            metric.nvmlReturn = 999 if metric.metricId in self.failing else 0
        return request


class FakeClock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def sample(registry: CollectorRegistry, name: str, gpu: str = "0", uuid: str = "GPU-h100") -> float | None:
    return registry.get_sample_value(name, {"model": "m", "gpu": gpu, "uuid": uuid})


def gpu_series(registry: CollectorRegistry) -> list[tuple[str, dict[str, str], float]]:
    return [
        (sample.name, sample.labels, sample.value)
        for metric in registry.collect()
        if metric.name.startswith("phasescope_gpu_")
        for sample in metric.samples
    ]


def wait_for_samples(registry: CollectorRegistry) -> None:
    """The sampler runs on its own thread; its first result lands after one interval."""
    deadline = time.monotonic() + 10
    while sample(registry, DRAM) is None:
        assert time.monotonic() < deadline, "no GPM sample within 10 s"
        time.sleep(0.01)


def sampler_of(nvml: FakeNvml, environ: dict[str, str], interval_seconds: float = 0.01, **kwargs: Any) -> GpmSampler:
    """A sampler whose thread is not started: the test calls sample_once itself."""
    return GpmSampler(nvml, gpm_capable(nvml, engine_gpus(nvml, environ)), "m", interval_seconds, **kwargs)


def test_supported_gpu_exports_measured_ratios() -> None:
    registry = CollectorRegistry()
    nvml = FakeNvml({10: 83.0, 5: 12.5, 2: 40.0})
    sampler = gpm_sampler("m", interval_seconds=0.01, nvml=nvml, environ={})
    assert sampler is not None
    registry.register(sampler)
    sampler.start()
    wait_for_samples(registry)
    sampler.close()
    assert sample(registry, DRAM) == 0.83
    assert sample(registry, TENSOR) == 0.125
    assert sample(registry, SM) == 0.40
    # The A100 (no GPM) is not sampled; samples are always freed.
    assert {handle for handle, _, _ in nvml.samples} == {"GPU-h100"}
    assert sample(registry, SM, gpu="1", uuid="GPU-a100") is None
    assert nvml.freed % 2 == 0
    assert nvml.freed > 0


def test_a_metric_whose_return_code_fails_is_absent_not_zero() -> None:
    registry = CollectorRegistry()
    nvml = FakeNvml({10: 50.0, 5: 1.0, 2: 2.0}, frozenset({5}))
    sampler = gpm_sampler("m", 0.01, nvml=nvml, environ={})
    assert sampler is not None
    registry.register(sampler)
    sampler.start()
    wait_for_samples(registry)
    sampler.close()
    assert sample(registry, DRAM) == 0.5
    assert sample(registry, TENSOR) is None


def test_only_the_gpus_cuda_visible_devices_names_by_uuid_are_sampled_labelled_as_the_engine_sees_them() -> None:
    gpus = [FakeGpu(f"GPU-{letter}{letter}{letter}-1234", bus=bus) for bus, letter in enumerate("abcd")]
    nvml = FakeNvml({}, gpus=gpus, values_by_gpu={"GPU-ccc-1234": {10: 70.0}, "GPU-aaa-1234": {10: 20.0}})
    registry = CollectorRegistry()
    # A UUID prefix is enough for CUDA, so it is for the sampler too.
    sampler = sampler_of(nvml, {"CUDA_VISIBLE_DEVICES": "GPU-ccc, GPU-aaa-1234"})
    registry.register(sampler)
    sampler.sample_once()
    assert {handle for handle, _, _ in nvml.samples} == {"GPU-ccc-1234", "GPU-aaa-1234"}
    assert sample(registry, DRAM, gpu="0", uuid="GPU-ccc-1234") == 0.7
    assert sample(registry, DRAM, gpu="1", uuid="GPU-aaa-1234") == 0.2
    assert len([series for series in gpu_series(registry) if series[0] == DRAM]) == 2


def test_indices_are_resolved_in_pci_bus_order_not_nvml_index_order(caplog: pytest.LogCaptureFixture) -> None:
    # NVML enumerates these out of PCI order: CUDA's PCI_BUS_ID order is y (bus 1), z (bus 2), x (bus 3).
    gpus = [FakeGpu("GPU-x", bus=3), FakeGpu("GPU-y", bus=1), FakeGpu("GPU-z", bus=2)]
    environ = {"CUDA_VISIBLE_DEVICES": "2,0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    with caplog.at_level(logging.INFO, logger="phasescope.telemetry.hardware.gpu_counters"):
        devices = engine_gpus(FakeNvml({}, gpus=gpus), environ)
    assert [(device.cuda_index, device.uuid) for device in devices] == [(0, "GPU-x"), (1, "GPU-y")]
    assert "assumed" not in caplog.text


def test_indices_under_cudas_default_order_are_assumed_to_be_pci_order_and_the_log_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    gpus = [FakeGpu("GPU-x", bus=3), FakeGpu("GPU-y", bus=1)]
    with caplog.at_level(logging.INFO, logger="phasescope.telemetry.hardware.gpu_counters"):
        devices = engine_gpus(FakeNvml({}, gpus=gpus), {"CUDA_VISIBLE_DEVICES": "1"})
    assert [(device.cuda_index, device.uuid) for device in devices] == [(0, "GPU-x")]
    assert "assumed to be CUDA's" in caplog.text
    assert "different models" not in caplog.text


def test_mixed_gpu_models_under_cudas_default_order_get_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    gpus = [FakeGpu("GPU-x", bus=1), FakeGpu("GPU-y", bus=2, name="NVIDIA L4", gpm=False)]
    with caplog.at_level(logging.WARNING, logger="phasescope.telemetry.hardware.gpu_counters"):
        devices = engine_gpus(FakeNvml({}, gpus=gpus), {})
    assert [device.uuid for device in devices] == ["GPU-x", "GPU-y"]
    assert "different models" in caplog.text


def test_cuda_visible_devices_stops_at_the_first_entry_cuda_cannot_resolve() -> None:
    gpus = [FakeGpu("GPU-x", bus=1), FakeGpu("GPU-y", bus=2)]
    assert [device.uuid for device in engine_gpus(FakeNvml({}, gpus=gpus), {"CUDA_VISIBLE_DEVICES": "1,-1,0"})] == [
        "GPU-y"
    ]
    assert engine_gpus(FakeNvml({}, gpus=gpus), {"CUDA_VISIBLE_DEVICES": ""}) == []
    assert engine_gpus(FakeNvml({}, gpus=gpus), {"CUDA_VISIBLE_DEVICES": "GPU-nope,0"}) == []


def test_every_gpu_is_sampled_once_then_one_wait_then_every_gpu_again() -> None:
    # Guards the old sampler's behaviour: it slept an interval per GPU in turn, so with 8 GPUs
    # each was measured over 1/8 of the time and the loop took 8 intervals.
    gpus = [FakeGpu(f"GPU-{index}", bus=index) for index in range(3)]
    nvml = FakeNvml({10: 10.0}, gpus=gpus)
    interval = 0.5
    sampler = sampler_of(nvml, {}, interval_seconds=interval)
    started = time.monotonic()
    sampler.sample_once()
    elapsed = time.monotonic() - started
    handles = [handle for handle, _, _ in nvml.samples]
    assert handles == ["GPU-0", "GPU-1", "GPU-2", "GPU-0", "GPU-1", "GPU-2"]
    times = [at for _, _, at in nvml.samples]
    assert times[3] - times[2] >= interval
    assert times[2] - times[0] < interval / 2
    assert times[5] - times[3] < interval / 2
    assert elapsed < 2 * interval, "one wait per round, not one per GPU"
    assert nvml.freed == 6


def test_values_older_than_three_intervals_are_left_out_of_collect() -> None:
    clock = FakeClock(100.0)
    nvml = FakeNvml({10: 60.0, 5: 30.0, 2: 90.0})
    sampler = sampler_of(nvml, {}, interval_seconds=0.01, clock=clock)
    registry = CollectorRegistry()
    registry.register(sampler)
    sampler.sample_once()
    assert [reading.measured_at_seconds for reading in sampler.readings()] == [100.0, 100.0, 100.0]
    clock.now = 100.02
    assert sample(registry, DRAM) == 0.6
    # The sampler is stuck (no further sample_once): once its values are stale they disappear.
    clock.now = 100.04
    assert sample(registry, DRAM) is None
    assert gpu_series(registry) == []
    # A new round brings them back.
    sampler.sample_once()
    assert sample(registry, DRAM) == 0.6


def test_a_mig_instance_is_sampled_through_its_parent_with_the_mig_call() -> None:
    parent = FakeGpu("GPU-parent", bus=1, migs=[("MIG-first", 1), ("MIG-second", 5)])
    nvml = FakeNvml({10: 45.0}, gpus=[parent, FakeGpu("GPU-other", bus=2)])
    registry = CollectorRegistry()
    sampler = gpm_sampler("m", 0.01, nvml=nvml, environ={"CUDA_VISIBLE_DEVICES": "MIG-second"}, clock=time.monotonic)
    assert sampler is not None
    registry.register(sampler)
    sampler.start()
    wait_for_samples_of(registry, uuid="MIG-second")
    sampler.close()
    assert {(handle, instance) for handle, instance, _ in nvml.samples} == {("GPU-parent", 5)}
    assert sample(registry, DRAM, gpu="0", uuid="MIG-second") == 0.45


def wait_for_samples_of(registry: CollectorRegistry, uuid: str) -> None:
    deadline = time.monotonic() + 10
    while sample(registry, DRAM, uuid=uuid) is None:
        assert time.monotonic() < deadline, "no GPM sample within 10 s"
        time.sleep(0.01)


def test_a_gpu_in_mig_mode_named_by_index_is_not_measured_as_a_whole(caplog: pytest.LogCaptureFixture) -> None:
    parent = FakeGpu("GPU-parent", bus=1, migs=[("MIG-first", 1)])
    with caplog.at_level(logging.INFO, logger="phasescope.telemetry.hardware.gpu_counters"):
        assert engine_gpus(FakeNvml({}, gpus=[parent]), {"CUDA_VISIBLE_DEVICES": "0"}) == []
    assert "MIG mode" in caplog.text


def test_a_driver_without_gpm_on_mig_leaves_the_instance_out_and_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    class NoMigGpm(FakeNvml):
        def nvmlGpmMigSampleGet(self, handle: str, gpu_instance_id: int, sample: object) -> object:
            self.samples.append((handle, gpu_instance_id, time.monotonic()))
            raise FakeNvmlError(self.NVML_ERROR_NOT_SUPPORTED)

    parent = FakeGpu("GPU-parent", bus=1, migs=[("MIG-first", 1)])
    nvml = NoMigGpm({10: 45.0}, gpus=[parent, FakeGpu("GPU-whole", bus=2)])
    environ = {"CUDA_VISIBLE_DEVICES": "MIG-first,GPU-whole"}
    sampler = sampler_of(nvml, environ)
    registry = CollectorRegistry()
    registry.register(sampler)
    with caplog.at_level(logging.INFO, logger="phasescope.telemetry.hardware.gpu_counters"):
        sampler.sample_once()
        sampler.sample_once()
    assert caplog.text.count("unsupported on MIG") == 1
    # Tried once, then no more; the whole GPU beside it is measured as usual.
    assert [(handle, instance) for handle, instance, _ in nvml.samples if instance is not None] == [("GPU-parent", 1)]
    assert sample(registry, DRAM, gpu="0", uuid="MIG-first") is None
    assert sample(registry, DRAM, gpu="1", uuid="GPU-whole") == 0.45
    # Two samples per device per round: two devices in the first round, one in the second.
    assert nvml.freed == 6


def test_an_nvidia_ml_py_without_the_mig_call_starts_nothing_for_a_mig_instance(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class OldBindings(FakeNvml):
        nvmlGpmMigSampleGet = None  # type: ignore[assignment]  # noqa: N815  # pynvml's name, made missing

    parent = FakeGpu("GPU-parent", bus=1, migs=[("MIG-first", 1)])
    with caplog.at_level(logging.INFO, logger="phasescope.telemetry.hardware.gpu_counters"):
        sampler = gpm_sampler("m", nvml=OldBindings({}, gpus=[parent]), environ={"CUDA_VISIBLE_DEVICES": "MIG-first"})
    assert sampler is None
    assert "unsupported on MIG" in caplog.text


def test_a_gpu_whose_sample_fails_is_skipped_while_the_others_are_measured() -> None:
    class OneBroken(FakeNvml):
        def nvmlGpmSampleGet(self, handle: str, sample: object) -> object:
            if handle == "GPU-broken":
                raise FakeNvmlError(999)
            return super().nvmlGpmSampleGet(handle, sample)

    nvml = OneBroken({10: 33.0}, gpus=[FakeGpu("GPU-broken", bus=1), FakeGpu("GPU-fine", bus=2)])
    sampler = sampler_of(nvml, {})
    registry = CollectorRegistry()
    registry.register(sampler)
    sampler.sample_once()
    assert sample(registry, DRAM, gpu="0", uuid="GPU-broken") is None
    assert sample(registry, DRAM, gpu="1", uuid="GPU-fine") == 0.33
    assert nvml.freed == 4


def test_no_supported_gpu_means_no_series_and_no_thread() -> None:
    class OldGpusOnly(FakeNvml):
        def nvmlGpmQueryDeviceSupport(self, handle: str) -> Any:
            return SimpleNamespace(isSupportedDevice=0)

    assert gpm_sampler("m", nvml=OldGpusOnly({}), environ={}) is None


def test_without_nvml_nothing_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    # pynvml absent, or no driver (load_nvml gives None): nothing fails, no series. Faked at the
    # boundary, so the test says the same on a GPU machine (it used to call the real NVML).
    monkeypatch.setattr(gpu_counters, "load_nvml", lambda: None)
    assert gpm_sampler("m") is None


def test_a_driver_that_fails_its_queries_turns_the_counters_off() -> None:
    class Broken(FakeNvml):
        def nvmlDeviceGetCount(self) -> int:
            raise RuntimeError("NVML_ERROR_DRIVER_NOT_LOADED")

    assert gpm_sampler("m", nvml=Broken({}), environ={}) is None
