"""A vLLM stat logger that turns each engine step into a `telemetry.steps.StepRecord`.

`SchedulerStats` is documented by vLLM as an unstable interface: this module
is the only reader of it. It needs the engine started with
`enable_logging_iteration_details` (per-step token counts and execution time)
and `enable_mfu_metrics` (vLLM's analytic FLOPs and bytes of the step).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm.config import VllmConfig
from vllm.v1.metrics.loggers import StatLoggerBase
from vllm.v1.metrics.stats import IterationStats, MultiModalCacheStats, SchedulerStats

from telemetry.steps import StepForwarder, StepRecord


class PhasescopeStatLogger(StatLoggerBase):
    def __init__(self, vllm_config: VllmConfig, engine_index: int, forward: StepForwarder) -> None:
        self._cache_config = vllm_config.cache_config
        self._engine_index = engine_index
        self._forward = forward

    def _kv_cache_capacity_tokens(self) -> int:
        # Known once the engine has profiled its memory; 0 until then.
        blocks = self._cache_config.num_gpu_blocks or 0
        return int(blocks * (self._cache_config.block_size or 0))

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        mm_cache_stats: MultiModalCacheStats | None = None,
        engine_idx: int = 0,
    ) -> None:
        if scheduler_stats is None:
            return
        self._forward.queue(
            engine_idx,
            scheduler_stats.num_running_reqs,
            scheduler_stats.num_waiting_reqs,
            scheduler_stats.kv_cache_usage,
        )
        details = scheduler_stats.iteration_details
        if details is None or details.is_dummy:
            return
        perf = scheduler_stats.perf_stats
        self._forward(
            StepRecord(
                engine=engine_idx,
                prefill_requests=details.num_ctx_requests,
                prefill_tokens=details.num_ctx_tokens,
                decode_requests=details.num_generation_requests,
                decode_tokens=details.num_generation_tokens,
                elapsed_seconds=details.elapsed_ms / 1e3,
                flops=float(perf.num_flops_per_gpu) if perf is not None else None,
                read_bytes=float(perf.num_read_bytes_per_gpu) if perf is not None else None,
                kv_cache_tokens=round(scheduler_stats.kv_cache_usage * self._kv_cache_capacity_tokens()),
            )
        )

    def log_engine_initialized(self) -> None:
        pass


def stat_logger_factory(forward: StepForwarder) -> Callable[[VllmConfig, int], Any]:
    """What `AsyncLLM(stat_loggers=[...])` takes: one logger per engine core."""

    def make(vllm_config: VllmConfig, engine_index: int = 0) -> PhasescopeStatLogger:
        return PhasescopeStatLogger(vllm_config, engine_index, forward)

    return make
