"""phasescope's telemetry inside each engine core: vLLM's scheduler, with every step reported where it runs.

vLLM loads a scheduler class by name in each engine core (`--scheduler-cls`, an ordinary engine argument), whatever
front end drives the core: phasescope's own, smg's Rust request path, vLLM's OpenAI server. `TelemetryScheduler`
(or `AsyncTelemetryScheduler` under vLLM's async scheduling) schedules exactly as vLLM's does and, once per step,
turns what the step did into a `StepReport` (phasescope.telemetry.step.records) that its publisher sends to the
hub named by `PHASESCOPE_TELEMETRY_ENDPOINT` (phasescope.telemetry.step.transport). Without that variable it is
vLLM's scheduler and nothing more.

Where each figure comes from, all in the engine core:
- the step's work: vLLM's own `compute_iteration_details` of the scheduler output (prompt chunks and decodes);
- its FLOPs and bytes: vLLM's `PerfStats` of the step (`--enable-mfu-metrics`), taken as the scheduler makes its
  stats;
- its time: from the moment the scheduler's batch was handed to the executor (the end of `schedule`, or the end of
  the previous step's update when steps overlap) to the moment its output came back (`update_from_output`);
- the inter-token gaps: each request's new tokens against its previous ones, on the output batch's own timestamp
  (`EngineCoreOutputs.timestamp`, which vLLM's front end takes as `first_token_ts` and `last_token_ts`);
- preemptions: the PREEMPTED events the step's outputs carry (as vLLM's front end counts them);
- the scheduler's state: its running and waiting queues and the KV cache's usage after the step.

`SchedulerStats` and the scheduler's internals are documented by vLLM as unstable: this module is the only
reader of them. Nothing here may raise into the engine loop (it would fail every request in flight): a step whose
report cannot be made is counted as dropped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreEventType
from vllm.v1.utils import compute_iteration_details

from phasescope.engine.vllm import ASYNC_TELEMETRY_SCHEDULER, TELEMETRY_SCHEDULER
from phasescope.engine.vllm.model_facts import engine_facts
from phasescope.environment import env_telemetry_endpoint, env_telemetry_gather_seconds
from phasescope.telemetry.step.records import (
    AdapterTokens,
    EngineIteration,
    EngineRequestRecord,
    SchedulerState,
    SpeculativeStep,
    StepRecord,
    StepReport,
)
from phasescope.telemetry.step.transport import GATHER_SECONDS, StepPublisher
from phasescope.telemetry.step.window import wait_reason

logger = logging.getLogger(__name__)

_QUEUED = EngineCoreEventType.QUEUED
_SCHEDULED = EngineCoreEventType.SCHEDULED
_PREEMPTED = EngineCoreEventType.PREEMPTED


class _Request:
    """What the engine core's outputs have said of one request so far (vLLM's front end keeps the same, in its
    `RequestStateStats`, from the same outputs)."""

    __slots__ = (
        "cached",
        "first_token",
        "last_token",
        "output_tokens",
        "preemptions",
        "prompt_tokens",
        "queued",
        "scheduled",
    )

    def __init__(self, prompt_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.cached = 0
        self.output_tokens = 0
        self.preemptions = 0
        self.queued = 0.0
        self.scheduled = 0.0
        self.first_token = 0.0
        self.last_token = 0.0

    def took(self, events: Any) -> int:
        """The request's events (QUEUED, SCHEDULED, PREEMPTED); its preemptions among them."""
        preempted = 0
        for event in events:
            kind = event.type
            if kind == _QUEUED:
                self.queued = event.timestamp
            elif kind == _SCHEDULED:
                if not self.scheduled:  # a preemption's rescheduling does not move it
                    self.scheduled = event.timestamp
            elif kind == _PREEMPTED:
                preempted += 1
        self.preemptions += preempted
        return preempted

    def record(self, request_id: str, engine: int, finish_reason: str) -> EngineRequestRecord:
        return EngineRequestRecord(
            request_id=request_id,
            engine=engine,
            finish_reason=finish_reason,
            prompt_tokens=self.prompt_tokens,
            cached_prompt_tokens=self.cached,
            output_tokens=self.output_tokens,
            queued_ts=self.queued,
            scheduled_ts=self.scheduled,
            first_token_ts=self.first_token,
            last_token_ts=self.last_token,
            preemptions=self.preemptions,
        )


def decode_tokens(generation_requests: int, generation_tokens: int, max_decode_tokens_per_request: int) -> int:
    """Positions decode computed in a step. vLLM counts a request resumed after preemption as "generation" (it has
    output tokens) while it recomputes its whole sequence: beyond one token per decoding sequence (plus its drafts
    when speculating) that is prefill work."""
    return min(generation_tokens, generation_requests * max_decode_tokens_per_request)


def speculative_step(stats: Any) -> SpeculativeStep | None:
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


class CoreTelemetry:
    """One engine core's step accounting: what the scheduler's hooks hand it, made into one report per step."""

    def __init__(
        self, scheduler: Scheduler, publisher: StepPublisher, clock: Callable[[], float] = time.monotonic
    ) -> None:
        config = scheduler.vllm_config
        self._clock = clock
        self.engine = publisher.engine
        self._scheduler = scheduler
        self._publisher = publisher
        # What ends the scheduler's admission of waiting requests in a step, beside the KV cache.
        self._max_num_seqs = int(config.scheduler_config.max_num_seqs)
        # And the distinct LoRA adapters a batch may run (0: LoRA is off).
        lora = getattr(config, "lora_config", None)
        self._max_loras = int(lora.max_loras) if lora is not None else 0
        self._token_budget = int(config.scheduler_config.max_num_batched_tokens)
        speculative = config.speculative_config
        # A decoding sequence computes one new token per step, plus its draft tokens when speculating.
        self._max_decode_tokens_per_request = 1 + (
            (speculative.num_speculative_tokens or 0) if speculative is not None else 0
        )
        # The core's own KV cache, sized before its scheduler is made: tokens = blocks × tokens per block.
        cache = config.cache_config
        self._kv_cache_capacity_tokens = (cache.num_gpu_blocks or 0) * (cache.block_size or 0)
        # When each scheduled batch went to the executor, by the scheduler output's identity.
        self._handed_at: dict[int, float] = {}
        # Each scheduled batch's LoRA adapters and their tokens, the same way (with LoRA on only).
        self._adapters_of: dict[int, tuple[AdapterTokens, ...]] = {}
        self._last_update_end = 0.0
        # Each request in the engine, by id: its stamps and counts so far.
        self._requests: dict[str, _Request] = {}
        # The step's PerfStats and SpecDecodingStats, as the scheduler passes them to `make_stats`.
        self._perf: Any = None
        self._speculation: Any = None
        self._in_update = False

    def scheduled(self, scheduler_output: Any) -> None:
        handed_at = self._handed_at[id(scheduler_output)] = self._clock()
        if not self._max_loras:
            return
        # Read now: a request the step finishes is freed before the step's report is made. Its time counts with the
        # step's hook; a failure drops the adapters of this step only, never reaches the engine loop.
        publisher = self._publisher
        try:
            self._adapters_of[id(scheduler_output)] = self._adapter_tokens(scheduler_output)
        except Exception:
            publisher.dropped_reports += 1
            logger.exception("phasescope could not read a step's LoRA adapters; the step is counted without them")
        publisher.hook_seconds += self._clock() - handed_at

    def stats_made(self, perf_stats: Any, spec_decoding_stats: Any) -> None:
        if self._in_update:
            self._perf, self._speculation = perf_stats, spec_decoding_stats

    def updating(self) -> float:
        """The step's output is back: its time ends now."""
        self._in_update = True
        self._perf = self._speculation = None
        return self._clock()

    def added(self, request: Any) -> None:
        # vLLM adds a streaming-input request again with each of its updates: it is one request.
        if request.request_id not in self._requests:
            self._requests[request.request_id] = _Request(int(request.num_prompt_tokens))

    def aborted(self, request_ids: Any, requests: dict[str, Any]) -> None:
        """Requests finished from outside the scheduler (None: all of them), before vLLM frees them (`requests`: the
        scheduler's): each one's record, published on its own (no step carries it)."""
        try:
            if request_ids is None:
                ids: Any = list(self._requests)
            else:
                ids = (request_ids,) if isinstance(request_ids, str) else request_ids
            finished = []
            for request_id in ids:
                state = self._requests.pop(request_id, None)
                if state is None:
                    continue
                engine_request = requests.get(request_id)
                if engine_request is not None and engine_request.events:  # stamped, not yet sent with an output
                    state.took(engine_request.events)
                finished.append(state.record(request_id, self.engine, "abort"))
            if finished:
                self._publisher.publish(StepReport(finished=tuple(finished)))
        except Exception:
            self._publisher.dropped_reports += 1
            logger.exception("phasescope could not account an aborted request; it is dropped")

    def updated(self, scheduler_output: Any, outputs: dict[int, Any], returned_at: float) -> None:
        """After the scheduler took in a step's output: build its report and hand it to the publisher."""
        began = self._clock()
        self._in_update = False
        publisher = self._publisher
        try:
            started = max(self._handed_at.pop(id(scheduler_output), returned_at), self._last_update_end)
            publisher.publish(self._report(scheduler_output, outputs, returned_at - started))
        except Exception:
            publisher.dropped_reports += 1
            logger.exception("phasescope could not account an engine step; it is dropped")
        self._last_update_end = ended = self._clock()
        # What this hook cost the engine loop (the other hooks are a clock read each).
        publisher.hook_seconds += ended - began
        publisher.hook_calls += 1

    def close(self) -> None:
        self._publisher.close()

    def _outputs(self, outputs: dict[int, Any]) -> tuple[EngineIteration | None, list[EngineRequestRecord]]:
        """The output batch's gaps, preemptions and tokens, and the requests it finished (as vLLM's front end
        derives them from the same outputs: `IterationStats.update_from_output`)."""
        # The gaps as runs of requests whose previous token came at the same time: each run's gap and length (a
        # decode step's requests mostly form one run, counted without a float made per request).
        gaps: list[float] = []
        counts: list[int] = []
        preemptions = emitted = 0
        finished: list[EngineRequestRecord] = []
        requests = self._requests
        for batch in outputs.values():
            at = batch.timestamp
            previous, run = 0.0, 0  # the run of requests whose previous token came at `previous`
            for output in batch.outputs:
                request_id = output.request_id
                state = requests.get(request_id)
                if state is None:  # added before this core's telemetry began
                    state = requests[request_id] = _Request(0)
                if output.events:
                    preemptions += state.took(output.events)
                tokens = len(output.new_token_ids)
                if tokens:
                    emitted += tokens
                    state.output_tokens += tokens
                    if state.first_token:
                        if state.last_token == previous:
                            run += 1
                        else:
                            if run:
                                gaps.append(at - previous)
                                counts.append(run)
                            previous, run = state.last_token, 1
                    else:
                        state.first_token = at
                        if output.prefill_stats is not None:  # the prompt's computed and cached tokens
                            state.cached = int(output.prefill_stats.num_cached_tokens)
                    state.last_token = at
                if output.finish_reason is not None:
                    del requests[request_id]
                    finished.append(state.record(request_id, self.engine, str(output.finish_reason)))
            if run:
                gaps.append(at - previous)
                counts.append(run)
        if not gaps and not preemptions and not emitted:
            return None, finished
        iteration = EngineIteration(
            engine=self.engine,
            inter_token_seconds=tuple(gaps),
            preemptions=preemptions,
            emitted_tokens=emitted,
            inter_token_counts=tuple(counts),
        )
        return iteration, finished

    def _report(self, scheduler_output: Any, outputs: dict[int, Any], elapsed_seconds: float) -> StepReport:
        scheduler = self._scheduler
        adapters = self._adapters_of.pop(id(scheduler_output), ()) if self._adapters_of else ()
        iteration, finished = self._outputs(outputs)
        running, waiting = scheduler.get_request_counts()
        deferred = len(scheduler.deferred_waiting)
        for_adapters = self._waiting_for_adapters() if self._max_loras and deferred else 0
        kv_cache_usage = float(scheduler.kv_cache_manager.usage)
        scheduled = int(scheduler_output.total_num_scheduled_tokens)
        state = SchedulerState(
            engine=self.engine,
            running=running,
            waiting=waiting - deferred + for_adapters,
            kv_cache_usage=kv_cache_usage,
            # Waiting requests the scheduler skips while blocked (a structured output's grammar still compiling),
            # but those it skips for want of an adapter slot: they wait, for `adapters`.
            deferred=deferred - for_adapters,
            waiting_for_adapters=for_adapters,
            reason=wait_reason(
                running,
                self._max_num_seqs,
                scheduled,
                self._token_budget,
                iteration is not None and iteration.preemptions > 0,
            ),
        )
        if not scheduled:
            return StepReport(iteration=iteration, scheduler=state, finished=tuple(finished))
        details = compute_iteration_details(scheduler_output)
        decode = decode_tokens(
            details.num_generation_requests, details.num_generation_tokens, self._max_decode_tokens_per_request
        )
        perf = self._perf
        step = StepRecord(
            engine=self.engine,
            prefill_requests=details.num_ctx_requests,
            prefill_tokens=details.num_ctx_tokens + details.num_generation_tokens - decode,
            decode_requests=details.num_generation_requests,
            decode_tokens=decode,
            elapsed_seconds=elapsed_seconds,
            flops=float(perf.num_flops_per_gpu) if perf is not None else None,
            read_bytes=float(perf.num_read_bytes_per_gpu) if perf is not None else None,
            written_bytes=float(perf.num_write_bytes_per_gpu) if perf is not None else None,
            kv_cache_tokens=round(kv_cache_usage * self._kv_cache_capacity_tokens),
            speculative=speculative_step(self._speculation),
            adapters=adapters,
        )
        return StepReport(iteration=iteration, scheduler=state, step=step, finished=tuple(finished))

    def _adapter_tokens(self, scheduler_output: Any) -> tuple[AdapterTokens, ...]:
        """Each distinct LoRA adapter the step ran and its sequences' tokens, prompt chunks apart from decodes (as
        vLLM's `compute_iteration_details` tells them apart: a new request or one still in its context phase)."""
        requests = self._scheduler.requests
        new = {request.req_id for request in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        tokens: dict[int, list[int]] = {}
        for request_id, count in scheduler_output.num_scheduled_tokens.items():
            request = requests.get(request_id)
            lora = request.lora_request if request is not None else None
            if lora is None:
                continue
            split = tokens.setdefault(lora.lora_int_id, [0, 0])
            split[0 if request_id in new or cached.is_context_phase(request_id) else 1] += count
        return tuple(AdapterTokens(adapter, prefill, decode) for adapter, (prefill, decode) in tokens.items())

    def _waiting_for_adapters(self) -> int:
        """The skipped requests whose LoRA adapter had no slot: the batch runs `max_loras` distinct adapters and
        theirs is not one (vLLM's scheduler skips them, and keeps them among its deferred requests)."""
        scheduler = self._scheduler
        running = {r.lora_request.lora_int_id for r in scheduler.running if r.lora_request is not None}
        if len(running) < self._max_loras:
            return 0
        return sum(
            1
            for request in scheduler.deferred_waiting
            if request.lora_request is not None and request.lora_request.lora_int_id not in running
        )


def _core_telemetry(scheduler: Scheduler) -> CoreTelemetry | None:
    endpoint = env_telemetry_endpoint()
    if not endpoint:
        return None
    engine = int(scheduler.vllm_config.parallel_config.data_parallel_index)
    gather = env_telemetry_gather_seconds()
    publisher = StepPublisher(
        endpoint,
        engine,
        facts=engine_facts(scheduler.vllm_config, engine),
        gather_seconds=GATHER_SECONDS if gather is None else gather,
    )
    publisher.start()
    logger.info("phasescope's step telemetry: engine core %d publishes to %s", engine, endpoint)
    return CoreTelemetry(scheduler, publisher)


class TelemetryScheduler(Scheduler):
    """vLLM's scheduler, each step reported to phasescope's hub (`--scheduler-cls` names it)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.phasescope_telemetry = _core_telemetry(self)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        scheduler_output = super().schedule(*args, **kwargs)
        if self.phasescope_telemetry is not None:
            self.phasescope_telemetry.scheduled(scheduler_output)
        return scheduler_output

    def make_stats(
        self,
        spec_decoding_stats: Any = None,
        kv_connector_stats: Any = None,
        cudagraph_stats: Any = None,
        perf_stats: Any = None,
        ec_connector_stats: Any = None,
    ) -> Any:
        if self.phasescope_telemetry is not None:
            self.phasescope_telemetry.stats_made(perf_stats, spec_decoding_stats)
        return super().make_stats(
            spec_decoding_stats, kv_connector_stats, cudagraph_stats, perf_stats, ec_connector_stats=ec_connector_stats
        )

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        telemetry = self.phasescope_telemetry
        if telemetry is None:
            return super().update_from_output(scheduler_output, model_runner_output)
        returned_at = telemetry.updating()
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        telemetry.updated(scheduler_output, outputs, returned_at)
        return outputs

    def add_request(self, request: Any) -> None:
        if self.phasescope_telemetry is not None:
            self.phasescope_telemetry.added(request)
        super().add_request(request)

    def finish_requests(self, request_ids: Any, finished_status: Any) -> Any:
        if self.phasescope_telemetry is not None:
            self.phasescope_telemetry.aborted(request_ids, self.requests)
        return super().finish_requests(request_ids, finished_status)

    def shutdown(self) -> None:
        super().shutdown()
        if self.phasescope_telemetry is not None:
            self.phasescope_telemetry.close()


class AsyncTelemetryScheduler(TelemetryScheduler, AsyncScheduler):
    """vLLM's async scheduler (`--async-scheduling`), each step reported to phasescope's hub."""


def telemetry_scheduler(async_scheduling: bool) -> str:
    """The scheduler class to name for an engine (vLLM's async scheduling has a scheduler of its own)."""
    return ASYNC_TELEMETRY_SCHEDULER if async_scheduling else TELEMETRY_SCHEDULER
