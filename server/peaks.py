"""Which peaks the running engine is judged against: flag, datasheet, or measured probe."""

from __future__ import annotations

import logging
import os

from server.config import Settings
from server.default_model import cache_root
from telemetry.hardware import HardwarePeaks, lookup_device
from telemetry.probe import cached_measure

logger = logging.getLogger(__name__)


def engine_threads() -> int:
    """The cores this process may run on: vLLM's CPU engine spreads its threads over the same set."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def resolve_peaks(settings: Settings, device_name: str, on_cpu: bool, dtype: str) -> HardwarePeaks:
    """Flags beat `--hardware`, which beats the detected GPU's datasheet row, which beats the probe."""
    peaks: HardwarePeaks | None = None
    if settings.hardware:
        peaks = lookup_device(settings.hardware)
    elif not on_cpu and not settings.probe_hardware:
        peaks = lookup_device(device_name)
        if peaks is None:
            logger.warning("no datasheet row for %r: measuring its peaks instead", device_name)
    if peaks is None and (settings.peak_memory_bandwidth is None or settings.peak_flops is None):
        result, cached = cached_measure(
            cache_root(), device="cpu" if on_cpu else "cuda", dtype=dtype, threads=engine_threads() if on_cpu else None
        )
        logger.info(
            "measured peaks%s: %.1f GB/s memory bandwidth, %.1f GFLOP/s %s matmul",
            " (cached)" if cached else "",
            result.memory_bandwidth_bytes_per_second / 1e9,
            result.matmul_flops_per_second / 1e9,
            dtype,
        )
        peaks = result.peaks()
    if peaks is None:
        # Both peaks were given as flags: nothing to look up or measure.
        peaks = HardwarePeaks(device_name, 1.0, {}, "flag", device_name)
    return peaks.with_overrides(settings.peak_memory_bandwidth, settings.peak_flops)
