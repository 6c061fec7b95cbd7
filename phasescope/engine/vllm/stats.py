"""A vLLM stat logger that turns each engine step into a `phasescope.telemetry.step.records.StepRecord`
and each output batch's per-token latencies into a `phasescope.telemetry.step.records.EngineIteration`;
and vLLM's own Prometheus logger with its reports held (`HeldPrometheusStatLogger`).

`SchedulerStats` is documented by vLLM as an unstable interface: this module
is the only reader of it. It needs the engine started with
`enable_logging_iteration_details` (per-step token counts and execution time)
and `enable_mfu_metrics` (vLLM's analytic FLOPs and bytes of the step).
"""

from __future__ import annotations

import copy
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import REGISTRY, Histogram
from prometheus_client.core import Metric
from prometheus_client.registry import Collector
from vllm.config import VllmConfig
from vllm.v1.metrics.loggers import PrometheusStatLogger, StatLoggerBase
from vllm.v1.metrics.stats import IterationStats, MultiModalCacheStats, SchedulerIterationDetails, SchedulerStats

from phasescope.telemetry.held import HandOnSoon, observe_all
from phasescope.telemetry.step.records import EngineIteration, LedgerEntry, StepForwarder, StepRecord, StepReport
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
            # This runs in the output handler between its passes, where every cache is cold: only the ledger's
            # entry is taken now (the requests this step woke read the ledger next); the report is built from
            # vLLM's objects when the held batch is handed on (`StepForwarder.report_held`).
            self._forward.report_held(
                self._report,
                (scheduler_stats, iteration_stats, engine_idx),
                self._ledger_entry(scheduler_stats, engine_idx),
            )
        except Exception as exc:
            self._forward.failed(exc)

    def _decode_tokens(self, details: SchedulerIterationDetails) -> int:
        # vLLM counts a request resumed after preemption as "generation" (it has output tokens) while it
        # recomputes its whole sequence: that is prefill work.
        return min(details.num_generation_tokens, details.num_generation_requests * self._max_decode_tokens_per_request)

    def _ledger_entry(self, scheduler_stats: SchedulerStats | None, engine_idx: int) -> LedgerEntry | None:
        """What the interference ledger takes of the step now (`_report`'s step, for a step that decoded)."""
        details = scheduler_stats.iteration_details if scheduler_stats is not None else None
        if details is None or details.is_dummy or not details.num_generation_requests:
            return None
        decode_tokens = self._decode_tokens(details)
        if not decode_tokens:
            return None
        # Prefill shared the step: prompt chunks, or a resumed request's recomputation.
        mixed = details.num_ctx_tokens > 0 or details.num_generation_tokens > decode_tokens
        return engine_idx, details.num_generation_requests, mixed, details.elapsed_ms / 1e3

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
            return iteration, None, None
        details = scheduler_stats.iteration_details
        scheduled = details.num_ctx_tokens + details.num_generation_tokens if details is not None else 0
        running = scheduler_stats.num_running_reqs
        queue = (
            engine_idx,
            running,
            scheduler_stats.num_waiting_reqs,
            scheduler_stats.kv_cache_usage,
            # Waiting requests the scheduler skips while blocked: on this worker (no KV transfer), those
            # whose structured output's grammar is still compiling.
            scheduler_stats.num_skipped_waiting_reqs,
            wait_reason(running, self._max_num_seqs, scheduled, self._token_budget, preempted),
        )
        if details is None or details.is_dummy:
            return iteration, queue, None
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
        )
        return iteration, queue, step

    def log_engine_initialized(self) -> None:
        pass


def stat_logger_factory(forward: StepForwarder) -> Callable[[VllmConfig, int], Any]:
    """What `AsyncLLM(stat_loggers=[...])` takes: one logger per engine core."""

    engines: list[int] = []

    def make(vllm_config: VllmConfig, engine_index: int = 0) -> PhasescopeStatLogger:
        engines.append(engine_index)
        return PhasescopeStatLogger(vllm_config, engine_index, forward, engines)

    return make


HELD_PROMETHEUS_STEPS = 32
"""Stats updates vLLM's Prometheus logger is handed at a time (`HeldPrometheusStatLogger`)."""


class HeldPrometheusStatLogger(PrometheusStatLogger):
    """vLLM's own `vllm:` series, exactly as its `PrometheusStatLogger` keeps them, with its reports held.

    vLLM's logger sets a dozen gauges and counters, each behind a lock, and observes its histograms for
    every stats update (every engine step); run between the output processor's passes, that is one of
    the front end's largest costs per step. Held and handed on `HELD_PROMETHEUS_STEPS` at a time, the
    same calls run with their caches warm, once the step's chunks are written (`HandOnSoon`). Every scrape of
    the registry hands on what is held first
    (`_HandOnHeld`, registered before vLLM's series), so a reader never sees the series late. vLLM
    takes a custom Prometheus logger in `AsyncLLM(stat_loggers=[...])` in place of its default one.
    """

    def __init__(self, vllm_config: VllmConfig, engine_indexes: list[int] | None = None) -> None:
        self._held: list[tuple[SchedulerStats | None, IterationStats | None, MultiModalCacheStats | None, int]] = []
        self._held_lock = threading.Lock()
        # A full batch is handed on after the step's chunks are written, not before them.
        self._hand_on_soon = HandOnSoon(self.hand_on)
        _HAND_ON_HELD.add(self)
        super().__init__(vllm_config, engine_indexes)

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        mm_cache_stats: MultiModalCacheStats | None = None,
        engine_idx: int = 0,
    ) -> None:
        with self._held_lock:
            self._held.append((scheduler_stats, iteration_stats, mm_cache_stats, engine_idx))
            if len(self._held) < HELD_PROMETHEUS_STEPS:
                return
        self._hand_on_soon()

    @property
    def held(self) -> int:
        """Reports held now."""
        return len(self._held)

    def hand_on(self) -> None:
        """Hand every held report to vLLM's logger, in order."""
        with self._held_lock:
            self._hand_on()

    def _hand_on(self) -> None:
        held, self._held = self._held, []
        # vLLM's logger observes every inter-token latency of a step on its own (one per running request, most of
        # its cost per step): the held steps' are observed here all at once, in order, to the same counts and sum.
        latencies: dict[int, list[float]] = {}
        for scheduler_stats, iteration_stats, mm_cache_stats, engine_idx in held:
            if iteration_stats is None or not iteration_stats.inter_token_latencies_iter:
                super().record(scheduler_stats, iteration_stats, mm_cache_stats=mm_cache_stats, engine_idx=engine_idx)
                continue
            latencies.setdefault(engine_idx, []).extend(iteration_stats.inter_token_latencies_iter)
            # A copy without them: vLLM's object is read by the step telemetry too, maybe on another thread.
            without = copy.copy(iteration_stats)
            without.inter_token_latencies_iter = []
            super().record(scheduler_stats, without, mm_cache_stats=mm_cache_stats, engine_idx=engine_idx)
        for engine_idx, amounts in latencies.items():
            histogram = self.histogram_inter_token_latency[engine_idx]
            assert isinstance(histogram, Histogram)  # vLLM types its per-engine children as any metric
            observe_all(histogram, amounts)

    def record_sleep_state(self, sleep: int = 0, level: int = 0) -> None:
        self.hand_on()
        super().record_sleep_state(sleep, level)


class _HandOnHeld(Collector):
    """Collects nothing: hands on what every live `HeldPrometheusStatLogger` holds, before the registry
    collects vLLM's series (it is registered first, and the registry collects in registration order)."""

    def __init__(self) -> None:
        self._loggers: weakref.WeakSet[HeldPrometheusStatLogger] = weakref.WeakSet()
        self._registered = False
        self._lock = threading.Lock()

    def add(self, logger: HeldPrometheusStatLogger) -> None:
        with self._lock:
            if not self._registered:
                REGISTRY.register(self)
                self._registered = True
            self._loggers.add(logger)

    def collect(self) -> Iterator[Metric]:
        for logger in list(self._loggers):
            logger.hand_on()
        return iter(())


_HAND_ON_HELD = _HandOnHeld()
