"""Measured GPU activity from NVML's GPM counters (Hopper or newer), beside the modelled figures.

`NVML_GPM_METRIC_DRAM_BW_UTIL` is the measured bandwidth saturation,
`NVML_GPM_METRIC_ANY_TENSOR_UTIL` the share of time any tensor core worked
(1 − it is measured tensor idleness), `NVML_GPM_METRIC_SM_UTIL` the share of
SMs busy. Without nvidia-ml-py, without a GPU, or on a GPU without GPM
support, nothing is started and the series are absent (not zero).

Which GPUs: the engine's, as CUDA shows them to it. `CUDA_VISIBLE_DEVICES`
(indices, `GPU-…` UUIDs or `MIG-…` UUIDs; unset: every GPU) is matched to
NVML devices by UUID, and each series is labelled with the GPU's index as the
engine sees it (`gpu`, its position in that list) and its `uuid`. NVML and
CUDA number GPUs differently, so an index is resolved in PCI bus order: that
is CUDA's order under `CUDA_DEVICE_ORDER=PCI_BUS_ID`, and under CUDA's default
(FASTEST_FIRST) it is CUDA's order only when the GPUs are alike, which is
assumed and said in the log.

How: one GPM sample of every GPU, one wait of `interval_seconds`, a second
sample of every GPU, then the metrics between each pair, on a background
thread (never the event loop). Every value keeps the monotonic time it was
measured at; `collect` leaves out values older than three intervals, so a
stuck sampler does not export old figures as live. A MIG instance is sampled
through its parent GPU with `nvmlGpmMigSampleGet`; where the driver or
nvidia-ml-py lacks it, that instance's series are absent and the log says so
once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

# Metric ids from nvml.h (NVML_GPM_METRIC_*), and the series each feeds.
_METRICS = (
    (10, "phasescope_gpu_dram_bandwidth_utilization_ratio", "Measured DRAM bandwidth used ÷ peak (NVML GPM)."),
    (5, "phasescope_gpu_tensor_active_ratio", "Measured share of time any tensor core was active (NVML GPM)."),
    (2, "phasescope_gpu_sm_active_ratio", "Measured share of SMs busy (NVML GPM)."),
)

# A value older than this many intervals is no longer exported: the sampler has stopped keeping it current.
STALE_AFTER_INTERVALS = 3


def load_nvml() -> ModuleType | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError when there is no driver or no GPU
        return None
    module: ModuleType = pynvml
    return module


@dataclass(frozen=True, slots=True)
class GpmDevice:
    """One GPU, or one MIG instance, that the engine uses, as NVML addresses it for GPM."""

    cuda_index: int
    """Its index as the engine sees it: its position among the devices CUDA shows the engine."""
    uuid: str
    handle: Any
    """The NVML handle GPM samples through: the GPU's own, or a MIG instance's parent GPU's."""
    gpu_instance_id: int | None = None
    """The MIG GPU instance id (sampled with nvmlGpmMigSampleGet); None for a whole GPU."""


@dataclass(frozen=True, slots=True)
class GpmReading:
    """One measured value, as the sampler last measured it."""

    series: str
    gpu: int
    uuid: str
    ratio: float
    measured_at_seconds: float
    """The monotonic clock at the second of the two samples the value comes from."""


@dataclass(frozen=True, slots=True)
class _Gpu:
    handle: Any
    uuid: str
    name: str
    mig_enabled: bool


def _text(value: object) -> str:
    """NVML strings come back as str from current nvidia-ml-py, as bytes from old ones."""
    return value.decode() if isinstance(value, bytes) else str(value)


def _physical_gpus(nvml: Any) -> list[_Gpu]:
    """Every GPU NVML sees, in PCI bus order (NVML's own index order is not guaranteed to be it)."""
    found: list[tuple[tuple[int, int, int], _Gpu]] = []
    for index in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        pci = nvml.nvmlDeviceGetPciInfo(handle)
        try:
            mig_enabled = nvml.nvmlDeviceGetMigMode(handle)[0] == nvml.NVML_DEVICE_MIG_ENABLE
        except Exception:  # NVMLError_NotSupported: a GPU without MIG
            mig_enabled = False
        gpu = _Gpu(handle, _text(nvml.nvmlDeviceGetUUID(handle)), _text(nvml.nvmlDeviceGetName(handle)), mig_enabled)
        found.append(((int(pci.domain), int(pci.bus), int(pci.device)), gpu))
    return [gpu for _, gpu in sorted(found, key=lambda pair: pair[0])]


def _mig_instances(nvml: Any, gpus: list[_Gpu]) -> list[tuple[str, Any, int]]:
    """(MIG UUID, parent GPU handle, GPU instance id) of every MIG instance of the GPUs in MIG mode."""
    instances = []
    for gpu in gpus:
        if not gpu.mig_enabled:
            continue
        for slot in range(nvml.nvmlDeviceGetMaxMigDeviceCount(gpu.handle)):
            try:
                mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu.handle, slot)
            except Exception:  # NVMLError_NotFound: an empty slot
                continue
            instances.append((_text(nvml.nvmlDeviceGetUUID(mig)), gpu.handle, nvml.nvmlDeviceGetGpuInstanceId(mig)))
    return instances


def _by_prefix(prefix: str, uuids: list[str]) -> int | None:
    """CUDA accepts any unambiguous prefix of a UUID; the matching position, or None."""
    matches = [position for position, uuid in enumerate(uuids) if uuid.lower().startswith(prefix.lower())]
    return matches[0] if len(matches) == 1 else None


def engine_gpus(nvml: Any, environ: Mapping[str, str]) -> list[GpmDevice]:
    """The devices CUDA shows a process with this environment, in CUDA's order, matched to NVML by UUID."""
    gpus = _physical_gpus(nvml)
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    entries = [str(position) for position in range(len(gpus))] if visible is None else visible.split(",")
    migs: list[tuple[str, Any, int]] | None = None
    devices: list[GpmDevice] = []
    by_index = False
    for cuda_index, raw in enumerate(entry.strip() for entry in entries):
        if raw.isdigit() and int(raw) < len(gpus):
            by_index = True
            gpu = gpus[int(raw)]
            if gpu.mig_enabled:
                # CUDA numbers the MIG instances of a GPU in MIG mode, not the GPU: an index cannot name one here.
                logger.info("GPU %s is in MIG mode: name its MIG instances by MIG-UUID to measure them", gpu.uuid)
                continue
            devices.append(GpmDevice(cuda_index, gpu.uuid, gpu.handle))
        elif raw.startswith("GPU-") and (position := _by_prefix(raw, [gpu.uuid for gpu in gpus])) is not None:
            devices.append(GpmDevice(cuda_index, gpus[position].uuid, gpus[position].handle))
        elif raw.startswith("MIG-"):
            migs = _mig_instances(nvml, gpus) if migs is None else migs
            position = _by_prefix(raw, [uuid for uuid, _, _ in migs])
            if position is None:
                logger.warning(
                    "CUDA_VISIBLE_DEVICES names %s, which matches no MIG instance (or several): not measured", raw
                )
                break
            uuid, parent, gpu_instance_id = migs[position]
            devices.append(GpmDevice(cuda_index, uuid, parent, gpu_instance_id))
        else:
            # CUDA itself stops at the first entry it cannot resolve and shows only the ones before it.
            if raw:
                logger.warning("CUDA_VISIBLE_DEVICES entry %r names no GPU here; CUDA ignores it and what follows", raw)
            break
    # With one GPU every order is the same one.
    if by_index and len(gpus) > 1 and environ.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID":
        logger.info(
            "CUDA_DEVICE_ORDER is not PCI_BUS_ID: GPU indices are taken in PCI bus order, assumed to be CUDA's "
            "(it is when the GPUs are alike); the uuid label names each GPU for certain"
        )
        if len({gpu.name for gpu in gpus}) > 1:
            logger.warning(
                "GPUs of different models (%s) under CUDA's FASTEST_FIRST order: indices may name other GPUs "
                "than the engine's; set CUDA_DEVICE_ORDER=PCI_BUS_ID or name the GPUs by UUID",
                ", ".join(sorted({gpu.name for gpu in gpus})),
            )
    return devices


def gpm_capable(nvml: Any, devices: list[GpmDevice]) -> list[GpmDevice]:
    """The devices whose GPU supports GPM and whose kind (whole GPU, MIG instance) this NVML can sample."""
    capable = []
    mig_logged = False
    for device in devices:
        if not nvml.nvmlGpmQueryDeviceSupport(device.handle).isSupportedDevice:
            continue
        if device.gpu_instance_id is not None and getattr(nvml, "nvmlGpmMigSampleGet", None) is None:
            if not mig_logged:
                logger.info("this nvidia-ml-py has no nvmlGpmMigSampleGet: measured counters are unsupported on MIG")
                mig_logged = True
            continue
        capable.append(device)
    return capable


class GpmSampler(Collector):
    """Samples the engine's GPUs every `interval_seconds` on a daemon thread; exports the values still current."""

    def __init__(
        self,
        nvml: Any,
        devices: list[GpmDevice],
        model: str,
        interval_seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._nvml = nvml
        self._devices = devices
        self._model = model
        self._interval = interval_seconds
        self._clock = clock
        self.stale_after_seconds = STALE_AFTER_INTERVALS * interval_seconds
        self._latest: dict[tuple[str, str], GpmReading] = {}
        self._unsupported: set[str] = set()
        self._failing: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nvml-gpm", daemon=True)

    def start(self) -> None:
        self._thread.start()
        logger.info(
            "sampling NVML GPM counters of GPUs %s every %.1f s",
            ", ".join(f"{device.cuda_index} ({device.uuid})" for device in self._devices),
            self._interval,
        )

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self._interval + 5)

    def sample_once(self) -> None:
        """A first GPM sample of every device, one wait of `interval_seconds`, a second of every device, the metrics."""
        nvml = self._nvml
        devices = [device for device in self._devices if device.uuid not in self._unsupported]
        allocated: list[Any] = []

        def allocate() -> Any:
            allocated.append(nvml.nvmlGpmSampleAlloc())
            return allocated[-1]

        try:
            pairs = [(device, allocate(), allocate()) for device in devices]
            started = [(device, first, second) for device, first, second in pairs if self._take(device, first)]
            if self._stop.wait(self._interval):
                return
            finished = [(device, first, second) for device, first, second in started if self._take(device, second)]
            measured_at = self._clock()
            readings: list[GpmReading] = []
            for device, first, second in finished:
                readings.extend(self._metrics(device, first, second, measured_at))
            with self._lock:
                self._latest.update({(reading.uuid, reading.series): reading for reading in readings})
        finally:
            for sample in allocated:
                nvml.nvmlGpmSampleFree(sample)

    def _take(self, device: GpmDevice, sample: Any) -> bool:
        """One GPM sample of one device; False (and the device skipped this round) when NVML refuses."""
        nvml = self._nvml
        try:
            if device.gpu_instance_id is None:
                nvml.nvmlGpmSampleGet(device.handle, sample)
            else:
                nvml.nvmlGpmMigSampleGet(device.handle, device.gpu_instance_id, sample)
        except Exception as error:
            unsupported = (nvml.NVML_ERROR_NOT_SUPPORTED, nvml.NVML_ERROR_FUNCTION_NOT_FOUND)
            if device.gpu_instance_id is not None and getattr(error, "value", None) in unsupported:
                logger.info("NVML GPM is unsupported on MIG instance %s by this driver: not measured", device.uuid)
                self._unsupported.add(device.uuid)
            else:
                self._failed(device, "sample")
            return False
        return True

    def _metrics(self, device: GpmDevice, first: Any, second: Any, measured_at: float) -> list[GpmReading]:
        nvml = self._nvml
        request = nvml.c_nvmlGpmMetricsGet_t()
        request.version = nvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(_METRICS)
        request.sample1, request.sample2 = first, second
        for slot, (metric_id, _, _) in enumerate(_METRICS):
            request.metrics[slot].metricId = metric_id
        try:
            nvml.nvmlGpmMetricsGet(request)
        except Exception:
            self._failed(device, "metrics")
            return []
        if device.uuid in self._failing:
            logger.info("NVML GPM sampling of %s works again", device.uuid)
            self._failing.discard(device.uuid)
        readings = []
        for slot, (_, name, _) in enumerate(_METRICS):
            metric = request.metrics[slot]
            # Each metric has its own return code: a failed one is skipped, not zeroed.
            if metric.nvmlReturn == nvml.NVML_SUCCESS:
                readings.append(
                    GpmReading(name, device.cuda_index, device.uuid, float(metric.value) / 100.0, measured_at)
                )
        return readings

    def _failed(self, device: GpmDevice, step: str) -> None:
        # Logged when a device starts failing, not on every interval it keeps failing.
        if device.uuid not in self._failing:
            logger.warning("NVML GPM %s of %s failed; its series are left out until it works", step, device.uuid)
            self._failing.add(device.uuid)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample_once()
            except Exception:
                logger.exception("NVML GPM sampling failed; retrying in %.0f s", self._interval)
                self._stop.wait(self._interval)

    def readings(self) -> list[GpmReading]:
        """The values measured within the last `stale_after_seconds`, by series then GPU."""
        now = self._clock()
        with self._lock:
            latest = list(self._latest.values())
        current = [reading for reading in latest if now - reading.measured_at_seconds <= self.stale_after_seconds]
        return sorted(current, key=lambda reading: (reading.series, reading.gpu, reading.uuid))

    def collect(self) -> Iterator[Metric]:
        readings = self.readings()
        for _, name, documentation in _METRICS:
            family = GaugeMetricFamily(name, documentation, labels=["model", "gpu", "uuid"])
            for reading in readings:
                if reading.series == name:
                    family.add_metric([self._model, str(reading.gpu), reading.uuid], reading.ratio)
            if family.samples:
                yield family


def gpm_sampler(
    model: str,
    interval_seconds: float = 1.0,
    nvml: Any | None = None,
    environ: Mapping[str, str] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> GpmSampler | None:
    """A sampler of the engine's GPUs that support GPM, not yet started nor registered; None (and no series) when
    none does.

    `environ` holds the engine's CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER (the server passes
    phasescope.environment.env_cuda_devices(); none: every GPU, in PCI order).
    """
    nvml = nvml if nvml is not None else load_nvml()
    if nvml is None:
        return None
    try:
        devices = gpm_capable(nvml, engine_gpus(nvml, {} if environ is None else environ))
    except Exception:
        logger.warning("NVML GPM support could not be queried; measured GPU counters are off", exc_info=True)
        return None
    if not devices:
        logger.info("none of the engine's GPUs supports NVML GPM (Hopper or newer needed): measured counters are off")
        return None
    return GpmSampler(nvml, devices, model, interval_seconds, clock)
