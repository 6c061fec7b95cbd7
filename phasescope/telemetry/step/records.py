"""What the engine reports each step, and the seam its reports cross (pure: no Prometheus here).

The engine reports every stats update as one `StepReport` (phasescope.engine.vllm.stats turns vLLM's
`SchedulerStats` and `IterationStats` into it: the step, the output batch's inter-token gaps, the scheduler's
state) through a `StepForwarder`, which hands it to the aggregator (`aggregator.StepAggregator`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

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
    inter_token_seconds: Sequence[float]
    """Every gap between a request's consecutive output tokens in this batch, on the engine core's clock."""
    preemptions: int


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
    """Why the waiting wait (`window.wait_reason`)."""


@dataclass(frozen=True, slots=True)
class StepReport:
    """One stats update of the engine, each part None when it has none."""

    iteration: EngineIteration | None = None
    scheduler: SchedulerState | None = None
    step: StepRecord | None = None


class StepForwarder:
    """Where the engine's stats updates go; an update made before a sink is attached is dropped.

    The engine needs its stat logger before it starts, the aggregator needs the engine's dtype and device,
    which are known only after: this sits between. Nothing a sink raises reaches the engine (vLLM would fail
    every request in flight): it goes to `on_error`.
    """

    def __init__(self, on_error: Callable[[str, BaseException], None] = lambda component, exc: None) -> None:
        self.sink: Callable[[StepReport], None] | None = None
        self.on_error = on_error

    def failed(self, exc: BaseException) -> None:
        self.on_error("step", exc)

    def report(self, report: StepReport) -> None:
        if self.sink is None:
            return
        try:
            self.sink(report)
        except Exception as exc:
            self.failed(exc)
