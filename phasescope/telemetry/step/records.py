"""What the engine reports each step, and the seam its reports cross (pure: no Prometheus here).

The engine reports every step (phasescope.engine.vllm.stats turns vLLM's SchedulerStats into a
`StepRecord`) and every output batch's inter-token gaps (`EngineIteration`) through a
`StepForwarder`, which hands them to the aggregator (`aggregator.StepAggregator`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

PHASES = ("prefill", "decode")
STEP_KINDS = ("prefill", "decode", "mixed")


# Made for every engine step, so slotted but not frozen (a frozen dataclass costs twice as much to make).
@dataclass(slots=True)
class StepRecord:
    """One engine step, as the engine core accounted it."""

    engine: int
    prefill_requests: int
    prefill_tokens: int
    """Prompt tokens computed, chunks and recomputation after preemption included."""
    decode_requests: int
    decode_tokens: int
    """New output tokens computed (one per decoding sequence, more with speculative decoding)."""
    elapsed_seconds: float
    """The step's execution time, measured in the engine core."""
    flops: float | None = None
    """The engine's own estimate for the step (vLLM --enable-mfu-metrics), per device."""
    read_bytes: float | None = None
    written_bytes: float | None = None
    kv_cache_tokens: int = 0
    """Tokens held in the KV cache at this step (read once by a decode step)."""

    @property
    def kind(self) -> str:
        """ "prefill" or "decode" when the step carried one phase only, else "mixed"."""
        if not self.decode_tokens:
            return "prefill"
        if not self.prefill_tokens:
            return "decode"
        return "mixed"


@dataclass(slots=True)  # one per output batch, as StepRecord
class EngineIteration:
    """Per-output-batch facts the engine's front end computed (vLLM's IterationStats)."""

    engine: int
    inter_token_seconds: Sequence[float]
    """Every gap between a request's consecutive output tokens in this batch, on the engine core's clock."""
    preemptions: int


QueueReport = tuple[int, int, int, float, int, str]
"""The engine's scheduler state at a stats update: engine, running, waiting, KV-cache usage, deferred, and why
the waiting wait (`StepForwarder.queue`)."""

StepReport = tuple[EngineIteration | None, QueueReport | None, StepRecord | None]
"""One stats update of the engine (`StepForwarder.report`): its output batch, its scheduler state, its step."""

LedgerEntry = tuple[int, int, bool, float]
"""What the interference ledger takes of a step that decoded, as soon as it is reported: the engine, its
decoding requests, whether prefill shared the step, and the step's seconds (`StepForwarder.report_held`)."""


HeldSink = Callable[[Callable[..., StepReport], tuple[object, ...], LedgerEntry | None], None]
"""Where `StepForwarder.report_held` hands a stats update to be built later."""


class StepForwarder:
    """Where the engine's reports go; reports seen before a sink is attached are dropped.

    The engine needs its stat logger before it starts, the sink needs the
    engine's dtype and device, which are known only after: this sits between.
    Nothing raised by a sink reaches the engine (vLLM would fail every request
    in flight): it goes to `on_error`.
    """

    def __init__(self, on_error: Callable[[str, BaseException], None] = lambda component, exc: None) -> None:
        self.sink: Callable[[StepRecord], None] | None = None
        self.iteration_sink: Callable[[EngineIteration], None] | None = None
        self.queue_sink: Callable[[int, int, int, float, int, str], None] | None = None
        self.report_sink: Callable[[EngineIteration | None, QueueReport | None, StepRecord | None], None] | None = None
        """Takes a whole stats update at once (`report`); without it, each part goes to its own sink."""
        self.held_sink: HeldSink | None = None
        """Takes a stats update to build later (`report_held`); without it, it is built and reported at once."""
        self.on_error = on_error

    def failed(self, exc: BaseException) -> None:
        self.on_error("step", exc)

    def _deliver(self, sink: Callable[..., None] | None, *report: object) -> None:
        if sink is None:
            return
        try:
            sink(*report)
        except Exception as exc:
            self.failed(exc)

    def __call__(self, step: StepRecord) -> None:
        self._deliver(self.sink, step)

    def iteration(self, iteration: EngineIteration) -> None:
        self._deliver(self.iteration_sink, iteration)

    def queue(
        self,
        engine: int,
        running: int,
        waiting: int,
        kv_cache_usage: float,
        deferred: int = 0,
        reason: str = "other",
    ) -> None:
        """The engine's scheduler state, reported with every stats update (also after aborts): `waiting`
        requests could be scheduled, `deferred` ones are held back (a structured output's grammar still
        compiling); `reason` is why the waiting wait (`window.wait_reason`)."""
        self._deliver(self.queue_sink, engine, running, waiting, kv_cache_usage, deferred, reason)

    def report(self, iteration: EngineIteration | None, queue: QueueReport | None, step: StepRecord | None) -> None:
        """One stats update of the engine, each part None when it has none: its output batch, its scheduler
        state, its step. `report_sink` takes them as one report (one hand-over per engine step); without it
        each goes to its own sink, in that order."""
        if self.report_sink is not None:
            self._deliver(self.report_sink, iteration, queue, step)
            return
        if iteration is not None:
            self._deliver(self.iteration_sink, iteration)
        if queue is not None:
            self._deliver(self.queue_sink, *queue)
        if step is not None:
            self._deliver(self.sink, step)

    def report_held(
        self, build: Callable[..., StepReport], raw: tuple[object, ...], ledger: LedgerEntry | None
    ) -> None:
        """One stats update, as the engine's own objects (`raw`) and how to make its report of them (`build`),
        with what the interference ledger takes of it now (None: the step decoded nothing). `held_sink` holds
        it and builds the report when it is handed on, with the held batch's caches warm; without it, the
        report is built and reported at once (`report`)."""
        if self.held_sink is not None:
            self._deliver(self.held_sink, build, raw, ledger)
            return
        try:
            report = build(*raw)
        except Exception as exc:
            self.failed(exc)
            return
        self.report(*report)
