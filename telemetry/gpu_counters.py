"""Measured GPU activity from NVML's GPM counters (Hopper or newer), beside the modelled figures.

`NVML_GPM_METRIC_DRAM_BW_UTIL` is the measured bandwidth saturation,
`NVML_GPM_METRIC_ANY_TENSOR_UTIL` the share of time any tensor core worked
(1 − it is measured tensor idleness), `NVML_GPM_METRIC_SM_UTIL` the share of
SMs busy. Sampling takes two GPM samples an interval apart, so it runs on a
background thread, never on the event loop. Without nvidia-ml-py, without a
GPU, or on a GPU without GPM support, nothing is started and the series are
absent (not zero).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

# Metric ids from nvml.h (NVML_GPM_METRIC_*), and the series each feeds.
_METRICS = (
    (10, "phasescope_gpu_dram_bandwidth_utilization_ratio", "Measured DRAM bandwidth used ÷ peak (NVML GPM)."),
    (5, "phasescope_gpu_tensor_active_ratio", "Measured share of time any tensor core was active (NVML GPM)."),
    (2, "phasescope_gpu_sm_active_ratio", "Measured share of SMs busy (NVML GPM)."),
)


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


class GpmSampler(Collector):
    """Samples every supported GPU each `interval_seconds` on a daemon thread; exports the latest values."""

    def __init__(self, nvml: Any, handles: dict[int, Any], model: str, interval_seconds: float) -> None:
        self._nvml = nvml
        self._handles = handles
        self._model = model
        self._interval = interval_seconds
        self._latest: dict[tuple[int, int], float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nvml-gpm", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self._interval + 5)

    def sample_once(self) -> None:
        """Two GPM samples `interval_seconds` apart per GPU, then the metrics between them."""
        nvml = self._nvml
        for index, handle in self._handles.items():
            first, second = nvml.nvmlGpmSampleAlloc(), nvml.nvmlGpmSampleAlloc()
            try:
                nvml.nvmlGpmSampleGet(handle, first)
                if self._stop.wait(self._interval):
                    return
                nvml.nvmlGpmSampleGet(handle, second)
                request = nvml.c_nvmlGpmMetricsGet_t()
                request.version = nvml.NVML_GPM_METRICS_GET_VERSION
                request.numMetrics = len(_METRICS)
                request.sample1, request.sample2 = first, second
                for slot, (metric_id, _, _) in enumerate(_METRICS):
                    request.metrics[slot].metricId = metric_id
                nvml.nvmlGpmMetricsGet(request)
                values: dict[tuple[int, int], float] = {}
                for slot, (metric_id, _, _) in enumerate(_METRICS):
                    metric = request.metrics[slot]
                    # Each metric has its own return code: a failed one is skipped, not zeroed.
                    if metric.nvmlReturn == nvml.NVML_SUCCESS:
                        values[(index, metric_id)] = float(metric.value) / 100.0
                with self._lock:
                    self._latest.update(values)
            finally:
                nvml.nvmlGpmSampleFree(first)
                nvml.nvmlGpmSampleFree(second)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample_once()
            except Exception:
                logger.exception("NVML GPM sampling failed; retrying in %.0f s", self._interval)
                self._stop.wait(self._interval)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            latest = dict(self._latest)
        for metric_id, name, documentation in _METRICS:
            family = GaugeMetricFamily(name, documentation, labels=["model", "gpu"])
            for (gpu, sampled_id), value in sorted(latest.items()):
                if sampled_id == metric_id:
                    family.add_metric([self._model, str(gpu)], value)
            if family.samples:
                yield family


def start_gpu_counters(
    registry: CollectorRegistry, model: str, interval_seconds: float = 1.0, nvml: Any | None = None
) -> GpmSampler | None:
    """Start sampling the GPUs that support GPM; None (and no series) when none does."""
    nvml = nvml if nvml is not None else load_nvml()
    if nvml is None:
        return None
    handles: dict[int, Any] = {}
    try:
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            if nvml.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice:
                handles[index] = handle
    except Exception:
        logger.warning("NVML GPM support could not be queried; measured GPU counters are off", exc_info=True)
        return None
    if not handles:
        logger.info("no GPU supports NVML GPM (Hopper or newer needed): measured GPU counters are off")
        return None
    sampler = GpmSampler(nvml, handles, model, interval_seconds)
    registry.register(sampler)
    sampler.start()
    logger.info("sampling NVML GPM counters of GPUs %s every %.1f s", sorted(handles), interval_seconds)
    return sampler
