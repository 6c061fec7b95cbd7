"""What the engine reports each step, and the seam its reports cross (pure: no Prometheus here).

Each engine core reports every step as one `StepReport` (phasescope.engine.vllm.core_telemetry builds it where
the step runs: the step, the output batch's inter-token gaps, the scheduler's state), publishes it to the hub
(`transport`), and the hub hands it to a `StepForwarder`, which hands it to the aggregator
(`aggregator.StepAggregator`) on the event loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass

from phasescope.telemetry.model.cost import ModelCost

PHASES = ("prefill", "decode")
STEP_KINDS = ("prefill", "decode", "mixed")


@dataclass(frozen=True, slots=True)
class SpeculativeStep:
    """What a step's verification did with the drafts it checked (speculative decoding; vLLM's SpecDecodingStats)."""

    drafts: int
    """Sequences that verified a draft this step."""
    drafted_tokens: int
    accepted_tokens: int
    accepted_by_position: tuple[int, ...] = ()
    """Accepted drafts at each draft position (1st, 2nd, … kth)."""
    drafted_by_position: tuple[int, ...] = ()

    @property
    def rejected_tokens(self) -> int:
        """Drafted tokens the verification threw away: positions computed that emitted nothing."""
        return self.drafted_tokens - self.accepted_tokens


@dataclass(frozen=True, slots=True)
class AdapterTokens:
    """What one LoRA adapter's sequences computed in a step."""

    adapter: int
    """The engine's id for the adapter (vLLM's lora_int_id)."""
    prefill_tokens: int
    decode_tokens: int


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One engine step, as the engine core accounted it."""

    engine: int
    prefill_requests: int
    prefill_tokens: int
    """Prompt tokens computed, chunks and recomputation after preemption included."""
    decode_requests: int
    decode_tokens: int
    """Positions decode computed: one per decoding sequence, plus its drafts under speculative decoding (the
    verify step checks them all, rejected drafts included)."""
    elapsed_seconds: float
    """The step's execution time, measured in the engine core."""
    flops: float | None = None
    """The engine's own estimate for the step (vLLM --enable-mfu-metrics), per device."""
    read_bytes: float | None = None
    written_bytes: float | None = None
    kv_cache_tokens: int = 0
    """Tokens held in the KV cache at this step (read once by a decode step)."""
    speculative: SpeculativeStep | None = None
    """What the step's verification accepted, under speculative decoding."""
    adapters: tuple[AdapterTokens, ...] = ()
    """Each distinct LoRA adapter the step ran, with its sequences' tokens (none: the base model only)."""

    @property
    def kind(self) -> str:
        """ "prefill" or "decode" when the step carried one phase only, else "mixed"."""
        if not self.decode_tokens:
            return "prefill"
        if not self.prefill_tokens:
            return "decode"
        return "mixed"


@dataclass(frozen=True, slots=True)
class EngineIteration:
    """Per-output-batch facts the engine's front end computed (vLLM's IterationStats)."""

    engine: int
    inter_token_seconds: tuple[float, ...]
    """The gaps between a request's consecutive output tokens in this batch, on the engine core's clock, as runs:
    each run of requests whose previous tokens came together has its gap here once and its length in
    `inter_token_counts` (a decode step's requests mostly got their previous token from the same earlier step: one
    run)."""
    preemptions: int
    emitted_tokens: int = 0
    """Output tokens the batch carried to the requests (every sample's)."""
    inter_token_counts: tuple[int, ...] = ()
    """How many requests had each of `inter_token_seconds`; empty: one each."""

    def gap_counts(self) -> tuple[int, ...]:
        """How many requests had each of `inter_token_seconds`."""
        return self.inter_token_counts or (1,) * len(self.inter_token_seconds)


@dataclass(frozen=True, slots=True)
class SchedulerState:
    """The engine's scheduler at a stats update (also after aborts)."""

    engine: int
    running: int
    waiting: int
    """Requests that could be scheduled."""
    kv_cache_usage: float
    deferred: int = 0
    """Requests held back (a structured output's grammar still compiling)."""
    reason: str = "other"
    """Why the waiting wait (`window.wait_reason`), those waiting for an adapter slot apart."""
    waiting_for_adapters: int = 0
    """Of `waiting`, requests for a LoRA adapter the batch has no slot for: `max_loras` distinct adapters run
    already and theirs is not one (vLLM's scheduler skips them while the batch may have room)."""


@dataclass(frozen=True, slots=True)
class EngineRequestRecord:
    """One request as its engine core saw it end: the engine's own stamps (monotonic, 0.0: never reached) and
    counts, the same vLLM's front end derives its request series from, and its id in the engine. No text."""

    engine: int
    finish_reason: str
    """"stop", "length", "abort" or "error"."""
    prompt_tokens: int
    cached_prompt_tokens: int
    output_tokens: int
    queued_ts: float
    scheduled_ts: float
    """The first SCHEDULED event (a preemption's rescheduling does not move it)."""
    first_token_ts: float
    last_token_ts: float
    preemptions: int = 0
    request_id: str = ""
    """The id the engine core ran it under: vLLM's Python front end makes a client's id unique with a suffix
    (`{id}-{8 hex digits}`); smg's Rust request path hands the engine the id it was sent (`{id}-{index}` for each
    of n > 1 samples)."""


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """What an engine core says of itself, so that a hub with no engine of its own can judge its steps."""

    engine: int
    model_name: str
    """The served model name."""
    model_path: str
    dtype: str
    device: str
    on_cpu: bool
    cost: ModelCost
    """The model's cost per device (sharded over tensor × pipeline parallelism)."""
    data_parallel_size: int
    kv_cache_capacity_tokens: int
    max_num_seqs: int
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    speculative_tokens: int = 0
    """k under speculative decoding (0: off)."""
    draft_cost: ModelCost | None = None
    """A draft model's cost per device (None: none, or a drafter that is host code)."""


@dataclass(frozen=True, slots=True)
class PublisherHealth:
    """What watching costs an engine core, since it started (cumulative; phasescope.telemetry.step.transport)."""

    engine: int
    dropped_reports: int
    """Reports the engine core's publisher dropped rather than wait (its queue full, or the hub slow or gone)."""
    hook_seconds: float
    """Time the engine loop spent building and queueing reports."""
    hook_calls: int
    """Engine steps the hook ran for."""


@dataclass(frozen=True, slots=True)
class StepReport:
    """One step of an engine core, each part None when it has none."""

    iteration: EngineIteration | None = None
    scheduler: SchedulerState | None = None
    step: StepRecord | None = None
    publisher: PublisherHealth | None = None
    finished: tuple[EngineRequestRecord, ...] = ()
    """Requests that ended in this step (or were aborted before it)."""


EARLY_REPORTS = 10_000
"""Reports a `StepForwarder` keeps for a sink not attached yet (beyond them, the earliest steps are left out)."""


class StepForwarder:
    """Where the engine's step reports go, once a sink is attached.

    The engine's cores publish from the moment they start, the aggregator needs the engine's dtype and device,
    which are known only after: this sits between. Nothing a sink raises reaches the hub: it goes to `on_error`.
    """

    def __init__(self, on_error: Callable[[str, BaseException], None] = lambda component, exc: None) -> None:
        self.sink: Callable[[StepReport], None] | None = None
        self.on_error = on_error
        self._loop: asyncio.AbstractEventLoop | None = None
        # Reports from the hub before a sink is attached (a hub learns what judges the steps from their first batch).
        self._early: list[StepReport] = []
        self._lock = threading.Lock()

    def attach(self, sink: Callable[[StepReport], None], *, on_loop: bool = True) -> None:
        """Hand reports to `sink` from now on (those the hub delivered before first), on the event loop this is
        called from (if any and `on_loop`), else on the thread that delivers them (the hub's)."""
        try:
            self._loop = asyncio.get_running_loop() if on_loop else None
        except RuntimeError:
            self._loop = None
        with self._lock:
            early, self._early = self._early, []
            self.sink = sink
        self._report_all(early)

    def failed(self, exc: BaseException) -> None:
        self.on_error("step", exc)

    def report_batch(self, reports: list[StepReport]) -> None:
        """Reports from another thread (the hub's): handed to the sink on the event loop, in order; before a sink
        is attached, kept for it (at most `EARLY_REPORTS`)."""
        with self._lock:
            if self.sink is None:
                self._early.extend(reports[: max(0, EARLY_REPORTS - len(self._early))])
                return
        loop = self._loop
        if loop is None:
            self._report_all(reports)
            return
        try:
            loop.call_soon_threadsafe(self._report_all, reports)
        except RuntimeError:  # the loop has closed: the server is stopping
            return

    def _report_all(self, reports: list[StepReport]) -> None:
        for report in reports:
            self.report(report)

    def report(self, report: StepReport) -> None:
        if self.sink is None:
            return
        try:
            self.sink(report)
        except Exception as exc:
            self.failed(exc)
