"""A vLLM stat logger that turns each engine step into a `phasescope.telemetry.step.records.StepRecord`
and each output batch's per-token latencies into a `phasescope.telemetry.step.records.EngineIteration`
(one `StepReport` per stats update); and vLLM's own Prometheus logger with its updates waiting in the
telemetry pipeline (`vllm_prometheus_logger`).

`SchedulerStats` is documented by vLLM as an unstable interface: this module
is the only reader of it. It needs the engine started with
`enable_logging_iteration_details` (per-step token counts and execution time)
and `enable_mfu_metrics` (vLLM's analytic FLOPs and bytes of the step).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from prometheus_client import Histogram
from vllm.config import VllmConfig
from vllm.v1.metrics.loggers import PrometheusStatLogger, StatLoggerBase
from vllm.v1.metrics.stats import IterationStats, MultiModalCacheStats, SchedulerIterationDetails, SchedulerStats

from phasescope.telemetry.histograms import observe_all
from phasescope.telemetry.pipeline import TelemetryPipeline
from phasescope.telemetry.step.records import (
    EngineIteration,
    SchedulerState,
    SpeculativeStep,
    StepForwarder,
    StepRecord,
    StepReport,
)
from phasescope.telemetry.step.window import wait_reason


class PhasescopeStatLogger(StatLoggerBase):
    def __init__(
        self, vllm_config: VllmConfig, engine_index: int, forward: StepForwarder, engines: list[int] | None = None
    ) -> None:
        self._cache_config = vllm_config.cache_config
        # The engine cores this front end talks to (one logger is made per engine core).
        self._engines = engines if engines is not None else [engine_index]
        self._engine_index = engine_index
        self._forward = forward
        # What ends the scheduler's admission of waiting requests in a step, beside the KV cache.
        self._max_num_seqs = int(vllm_config.scheduler_config.max_num_seqs)
        self._token_budget = int(vllm_config.scheduler_config.max_num_batched_tokens)
        speculative = vllm_config.speculative_config
        # A decoding sequence computes one new token per step, plus its draft tokens when
        # speculating; more than that is a resumed request recomputing what preemption dropped.
        self._max_decode_tokens_per_request = 1 + (
            (speculative.num_speculative_tokens or 0) if speculative is not None else 0
        )

    def _kv_cache_capacity_tokens(self) -> int:
        # Known once the engine has profiled its memory; 0 until then. With data parallelism the
        # front end's figure is the sum over its engine cores (vLLM's core client adds them up):
        # each engine's own cache is its equal share.
        blocks = (self._cache_config.num_gpu_blocks or 0) / max(1, len(self._engines))
        return int(blocks * (self._cache_config.block_size or 0))

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        mm_cache_stats: MultiModalCacheStats | None = None,
        engine_idx: int = 0,
    ) -> None:
        # vLLM fails every request in flight when a stat logger raises: nothing may escape.
        try:
            self._forward.report(self._report(scheduler_stats, iteration_stats, engine_idx))
        except Exception as exc:
            self._forward.failed(exc)

    def _decode_tokens(self, details: SchedulerIterationDetails) -> int:
        # vLLM counts a request resumed after preemption as "generation" (it has output tokens) while it
        # recomputes its whole sequence: that is prefill work.
        return min(details.num_generation_tokens, details.num_generation_requests * self._max_decode_tokens_per_request)

    def _report(
        self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None, engine_idx: int
    ) -> StepReport:
        """The stats update's report: its output batch, its scheduler state, its step (each None when it has none)."""
        iteration = None
        preempted = False
        if iteration_stats is not None:
            preempted = iteration_stats.num_preempted_reqs > 0
            iteration = EngineIteration(
                engine=engine_idx,
                inter_token_seconds=iteration_stats.inter_token_latencies_iter,
                preemptions=iteration_stats.num_preempted_reqs,
            )
        if scheduler_stats is None:
            return StepReport(iteration=iteration)
        details = scheduler_stats.iteration_details
        scheduled = details.num_ctx_tokens + details.num_generation_tokens if details is not None else 0
        running = scheduler_stats.num_running_reqs
        scheduler = SchedulerState(
            engine=engine_idx,
            running=running,
            waiting=scheduler_stats.num_waiting_reqs,
            kv_cache_usage=scheduler_stats.kv_cache_usage,
            # Waiting requests the scheduler skips while blocked: on this worker (no KV transfer), those
            # whose structured output's grammar is still compiling.
            deferred=scheduler_stats.num_skipped_waiting_reqs,
            reason=wait_reason(running, self._max_num_seqs, scheduled, self._token_budget, preempted),
        )
        if details is None or details.is_dummy:
            return StepReport(iteration=iteration, scheduler=scheduler)
        perf = scheduler_stats.perf_stats
        decode_tokens = self._decode_tokens(details)
        recomputed_tokens = details.num_generation_tokens - decode_tokens
        step = StepRecord(
            engine=engine_idx,
            prefill_requests=details.num_ctx_requests,
            prefill_tokens=details.num_ctx_tokens + recomputed_tokens,
            decode_requests=details.num_generation_requests,
            decode_tokens=decode_tokens,
            elapsed_seconds=details.elapsed_ms / 1e3,
            flops=float(perf.num_flops_per_gpu) if perf is not None else None,
            read_bytes=float(perf.num_read_bytes_per_gpu) if perf is not None else None,
            written_bytes=float(perf.num_write_bytes_per_gpu) if perf is not None else None,
            kv_cache_tokens=round(scheduler_stats.kv_cache_usage * self._kv_cache_capacity_tokens()),
            speculative=_speculative_step(scheduler_stats.spec_decoding_stats),
        )
        return StepReport(iteration=iteration, scheduler=scheduler, step=step)

    def log_engine_initialized(self) -> None:
        pass


def _speculative_step(stats: Any) -> SpeculativeStep | None:
    """The step's verification, from vLLM's `SpecDecodingStats` (None: no draft was verified this step)."""
    if stats is None or not stats.num_drafts:
        return None
    return SpeculativeStep(
        drafts=stats.num_drafts,
        drafted_tokens=stats.num_draft_tokens,
        accepted_tokens=stats.num_accepted_tokens,
        accepted_by_position=tuple(stats.num_accepted_tokens_per_pos),
        drafted_by_position=tuple(stats.num_draft_tokens_per_pos),
    )


def stat_logger_factory(forward: StepForwarder) -> Callable[[VllmConfig, int], Any]:
    """What `AsyncLLM(stat_loggers=[...])` takes: one logger per engine core."""

    engines: list[int] = []

    def make(vllm_config: VllmConfig, engine_index: int = 0) -> PhasescopeStatLogger:
        engines.append(engine_index)
        return PhasescopeStatLogger(vllm_config, engine_index, forward, engines)

    return make


def vllm_prometheus_logger(pipeline: TelemetryPipeline) -> type[PrometheusStatLogger]:
    """vLLM's own Prometheus logger (its `vllm:` series, exactly as it keeps them), its stats updates waiting in
    `pipeline` with phasescope's telemetry. vLLM takes a Prometheus logger class in `AsyncLLM(stat_loggers=[...])`
    in place of its default one and makes it itself, hence a class made here around the pipeline."""

    class PipelinedPrometheusStatLogger(PrometheusStatLogger):
        def record(
            self,
            scheduler_stats: SchedulerStats | None,
            iteration_stats: IterationStats | None,
            mm_cache_stats: MultiModalCacheStats | None = None,
            engine_idx: int = 0,
        ) -> None:
            pipeline.hold(self._record_now, scheduler_stats, iteration_stats, mm_cache_stats, engine_idx)

        def _record_now(
            self,
            scheduler_stats: SchedulerStats | None,
            iteration_stats: IterationStats | None,
            mm_cache_stats: MultiModalCacheStats | None,
            engine_idx: int,
        ) -> None:
            if iteration_stats is None or not iteration_stats.inter_token_latencies_iter:
                super().record(scheduler_stats, iteration_stats, mm_cache_stats=mm_cache_stats, engine_idx=engine_idx)
                return
            # vLLM observes each inter-token gap on its own (one per running request, most of its cost per
            # step); here the step's are observed together, to the same counts and sum. A copy without them:
            # vLLM's object is read by the step telemetry too.
            without = copy.copy(iteration_stats)
            without.inter_token_latencies_iter = []
            super().record(scheduler_stats, without, mm_cache_stats=mm_cache_stats, engine_idx=engine_idx)
            histogram = self.histogram_inter_token_latency[engine_idx]
            assert isinstance(histogram, Histogram)  # vLLM types its per-engine children as any metric
            observe_all(histogram, iteration_stats.inter_token_latencies_iter)

        def record_sleep_state(self, sleep: int = 0, level: int = 0) -> None:
            pipeline.hand_on()
            super().record_sleep_state(sleep, level)

    return PipelinedPrometheusStatLogger
