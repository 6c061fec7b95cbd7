"""The engine's steps, aggregated once for every reader: the window, the interference ledger, the views.

vLLM's v1 metrics keep the data (`stats.py`) apart from where it is sent (`loggers.py`); so does
this room. `StepAggregator` takes every report the engine makes (through
`records.StepForwarder`), attributes each step to the phases once, and keeps what every reader
asks of it: the window's figures, each engine's view with its verdicts, headroom and cost, and the
interference totals a request reads for its own decode. Sinks (the Prometheus export) are told of
each report with the attribution already made (`StepSink`, whose methods do nothing by default);
live readers (WatchTelemetry, `top`) and the Prometheus gauges read the views. Removing a sink
changes nothing else.

With `batch_reports` above 1 the reports are held, each stamped with its time, and handed on
together (the same code run for 32 steps in a row costs the front end half as much per step as
when it runs between the output processor's passes). Every reader sees them all: `views` and
`flush_reports` deliver what is held first. The interference ledger is not held: a request reads
its totals at every step, and a step costs it a few dictionary updates.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from phasescope.telemetry.hardware.peaks import HardwarePeaks
from phasescope.telemetry.held import HandOnSoon
from phasescope.telemetry.model.cost import ModelCost
from phasescope.telemetry.step.attribution import StepAttributor, StepCost
from phasescope.telemetry.step.interference import Interference, InterferenceLedger
from phasescope.telemetry.step.records import (
    PHASES,
    EngineIteration,
    LedgerEntry,
    QueueReport,
    StepRecord,
    StepReport,
)
from phasescope.telemetry.step.verdict import (
    Headroom,
    HeadroomLimits,
    PhaseWork,
    Verdict,
    headroom,
    phase_verdict,
    token_cost,
)
from phasescope.telemetry.step.window import DEFAULT_WINDOW_SECONDS, DeviceFigures, PhaseFigures, StepWindow


@dataclass(frozen=True, slots=True)
class PhaseView:
    figures: PhaseFigures
    verdict: Verdict
    cost_per_million_tokens: float | None


@dataclass(frozen=True, slots=True)
class EngineView:
    """One engine over the window: what the answer series and a live snapshot show."""

    engine: int
    device: DeviceFigures
    phases: dict[str, PhaseView]
    running: int
    waiting: int
    kv_cache_usage: float
    queue_share: float
    headroom: Headroom
    idle_cost_per_hour: float | None
    kv_cache_capacity_tokens: int = 0
    """Tokens the engine's KV cache holds: its blocks × tokens per block (0: unknown)."""
    waiting_reason: str = "other"
    """Why its waiting requests wait now (`window.WAIT_REASONS`)."""
    wait_shares: dict[str, float] | None = None
    """The share of request time in the engine spent waiting, by reason, over the window."""
    preemptions: int = 0
    """Requests preempted for KV-cache blocks over the window."""
    sequences_fit: float | None = None
    """Sequences the cache holds at the window's mean context (None: nothing ran in the window)."""

    @property
    def kv_cache_tokens(self) -> int:
        """Tokens of KV cache in use now."""
        return round(self.kv_cache_usage * self.kv_cache_capacity_tokens)


class StepSink:
    """Where each report goes once aggregated; every method does nothing unless a sink needs it."""

    def step(self, step: StepRecord, cost: StepCost) -> None:
        """One engine step, with its attribution to the phases."""

    def iteration(self, iteration: EngineIteration, at: float | None = None) -> None:
        """One output batch's inter-token gaps and preemptions, reported at `at` (None: now)."""

    def queue(self, engine: int, running: int, waiting: int, kv_cache_usage: float, deferred: int = 0) -> None:
        """The engine's scheduler state at a stats update."""

    def flushed(self) -> None:
        """The reports held so far have all been handed on (a sink that sums them publishes now)."""


class StepAggregator:
    """The engines' steps against the device's peaks: the window, the ledger and the views.

    `peaks` are what each engine is judged against (`HardwarePeaks.shared_by` when the engines
    share one CPU).
    """

    def __init__(
        self,
        cost: ModelCost,
        dtype: str,
        peaks: HardwarePeaks,
        *,
        engines: int = 1,
        window_seconds: float = DEFAULT_WINDOW_SECONDS,
        clock: Callable[[], float] = time.monotonic,
        headroom_limits: HeadroomLimits | None = None,
        cost_per_hour: float | None = None,
        sinks: Iterable[StepSink] = (),
        kv_cache_capacity_tokens: int = 0,
        batch_reports: int = 1,
        on_error: Callable[[str, BaseException], None] = lambda component, exc: None,
    ) -> None:
        """`cost_per_hour` is each engine's price (None: no cost figures); `kv_cache_capacity_tokens` its KV
        cache's size (0: unknown). `batch_reports`: how many reports are held before they are handed on
        (1: each at once); a held report that fails to aggregate goes to `on_error`."""
        self.kv_cache_capacity_tokens = kv_cache_capacity_tokens
        self.cost = cost
        self.dtype = dtype
        self.peaks = peaks
        self.engines = engines
        self._headroom_limits = headroom_limits or HeadroomLimits()
        self.cost_per_hour = cost_per_hour
        self.window = StepWindow(
            engines, self.peak_memory_bandwidth_bytes_per_second, self.peak_flops, window_seconds, clock
        )
        self.interference = InterferenceLedger()
        self.read_interference: Callable[[int], Interference] = self.interference.read
        """An engine's running interference totals, for a request to difference over its decode (the ledger's
        own reader: every request reads it at every step, so one call, not two)."""
        self._sinks: tuple[StepSink, ...] = tuple(sinks)
        self._attributor: StepAttributor | None = None
        self._clock = clock
        self._batch = max(1, batch_reports)
        self._on_error = on_error
        # Held reports (how to deliver it, when it was made, what it said), in the order they came.
        self._held: list[tuple[Callable[..., None], float, tuple[object, ...]]] = []
        self._held_lock = threading.Lock()
        # One delivery at a time (the engine's thread, a scrape's, a watcher's), in order.
        self._delivery = threading.Lock()
        # A full batch is handed on after the step's chunks are written, not before them.
        self._flush_soon = HandOnSoon(self.flush_reports)

    def _attribute(self, step: StepRecord) -> StepCost:
        # Made at the first step: a device with no peak FLOP/s for the dtype fails each step, not the start.
        if self._attributor is None:
            self._attributor = StepAttributor(self.cost, self.peak_memory_bandwidth_bytes_per_second, self.peak_flops)
        return self._attributor(step)

    def add_sink(self, sink: StepSink) -> None:
        self._sinks = (*self._sinks, sink)

    @property
    def peak_memory_bandwidth_bytes_per_second(self) -> float:
        return self.peaks.memory_bandwidth_bytes_per_second

    @property
    def peak_flops(self) -> float:
        return self.peaks.peak_flops(self.dtype)

    def record(self, step: StepRecord) -> None:
        self._ledger(step)
        self._hold(self._record, (step,))

    def record_report(
        self, iteration: EngineIteration | None, queue: QueueReport | None, step: StepRecord | None
    ) -> None:
        """One stats update of the engine (`records.StepForwarder.report`), held as one report."""
        if step is not None:
            self._ledger(step)
        self._hold(self._record_report, (iteration, queue, step))

    def record_held(
        self, build: Callable[..., StepReport], raw: tuple[object, ...], ledger: LedgerEntry | None
    ) -> None:
        """One stats update, its report built when it is handed on (`records.StepForwarder.report_held`); the
        ledger's entry now, as `record_report` makes it."""
        if ledger is not None:
            engine, decode_requests, mixed, elapsed_seconds = ledger
            decode_share = 0.0
            if mixed and not self.interference.has_reference(engine):
                # Before the engine's first decode-only step only: the step's roofline split stands in.
                step = build(*raw)[2]
                if step is not None:
                    decode_share = self._attribute(step).shares["decode"].seconds
            self.interference.add(engine, decode_requests, mixed, elapsed_seconds, decode_share)
        self._hold(self._record_built, (build, raw))

    def _record_built(self, build: Callable[..., StepReport], raw: tuple[object, ...], at: float) -> None:
        self._record_report(*build(*raw), at=at)

    def _ledger(self, step: StepRecord) -> None:
        # The ledger now, held or not: the requests whose tokens this step made read its totals next.
        decode_share = 0.0
        if step.kind == "mixed" and not self.interference.has_reference(step.engine):
            decode_share = self._attribute(step).shares["decode"].seconds
        self.interference.record(step, decode_share)

    def record_iteration(self, iteration: EngineIteration) -> None:
        self._hold(self._record_iteration, (iteration,))

    def record_queue(
        self,
        engine: int,
        running: int,
        waiting: int,
        kv_cache_usage: float,
        deferred: int = 0,
        reason: str = "other",
    ) -> None:
        self._hold(self._record_queue, (engine, running, waiting, kv_cache_usage, deferred, reason))

    def _hold(self, deliver: Callable[..., None], report: tuple[object, ...]) -> None:
        with self._held_lock:
            self._held.append((deliver, self._clock(), report))
            full = len(self._held) >= self._batch
        if full:
            self._flush_soon()

    def flush_reports(self) -> None:
        """Hand on every held report, in order, each at the time it was made (readers call this first)."""
        with self._delivery:
            with self._held_lock:
                held, self._held = self._held, []
            for deliver, at, report in held:
                self._contained(deliver, report, at)
            for sink in self._sinks:
                try:
                    sink.flushed()
                except Exception as exc:
                    self._on_error("step", exc)

    def _record_report(
        self, iteration: EngineIteration | None, queue: QueueReport | None, step: StepRecord | None, at: float
    ) -> None:
        # Each part as if handed on alone: one that cannot be aggregated costs that part only.
        if iteration is not None:
            self._contained(self._record_iteration, (iteration,), at)
        if queue is not None:
            self._contained(self._record_queue, queue, at)
        if step is not None:
            self._contained(self._record, (step,), at)

    def _contained(self, deliver: Callable[..., None], report: tuple[object, ...], at: float) -> None:
        try:
            deliver(*report, at=at)
        except Exception as exc:  # a report that cannot be aggregated costs that report only
            self._on_error("step", exc)

    def _record(self, step: StepRecord, at: float) -> None:
        """A step made at `at` (its interference entry was made when it came)."""
        cost = self._attribute(step)
        self.window.add(step, cost, at)
        for sink in self._sinks:
            sink.step(step, cost)

    def _record_iteration(self, iteration: EngineIteration, at: float) -> None:
        if iteration.preemptions:
            self.window.add_preemptions(iteration.engine, iteration.preemptions, at)
        for sink in self._sinks:
            sink.iteration(iteration, at)

    def _record_queue(
        self,
        engine: int,
        running: int,
        waiting: int,
        kv_cache_usage: float,
        deferred: int,
        reason: str,
        at: float,
    ) -> None:
        self.window.add_queue(engine, running, waiting, kv_cache_usage, reason, at)
        for sink in self._sinks:
            sink.queue(engine, running, waiting, kv_cache_usage, deferred)

    def views(self) -> tuple[float, list[EngineView]]:
        """The window's length and, per engine, every figure with its verdicts, headroom and cost."""
        self.flush_reports()
        phases, devices = self.window.figures()
        return self.window.length(), self.views_of(phases, devices)

    def views_of(
        self, phases: dict[tuple[int, str], PhaseFigures], devices: dict[int, DeviceFigures]
    ) -> list[EngineView]:
        """Each engine's view of figures already read from the window (a scrape reads them once)."""
        length = self.window.length()
        wait_shares = self.window.wait_shares()
        preemptions = self.window.preemptions()
        fits = self.window.sequences_fit()
        schedulers = self.window.schedulers()
        views = []
        for engine, device in devices.items():
            waits = wait_shares.get(engine, {})
            share = sum(waits.values())
            preempted = preemptions.get(engine, 0)
            running, waiting, kv_usage = schedulers.get(engine, (0, 0, 0.0))
            cost = None
            if self.cost_per_hour is not None:
                cost = token_cost(
                    self.cost_per_hour,
                    length,
                    {phase: phases[(engine, phase)].busy_seconds for phase in PHASES},
                    {phase: phases[(engine, phase)].tokens_per_second * length for phase in PHASES},
                    device.compute_idle,
                )
            phase_views = {}
            for phase in PHASES:
                figures = phases[(engine, phase)]
                work = PhaseWork(
                    figures.busy_seconds, figures.memory_seconds, figures.compute_seconds, figures.predicted_seconds
                )
                phase_views[phase] = PhaseView(
                    figures,
                    phase_verdict(phase, work, length, share, waits.get("kv_cache", 0.0), preempted),
                    cost.per_million_tokens.get(phase) if cost is not None else None,
                )
            views.append(
                EngineView(
                    engine=engine,
                    device=device,
                    phases=phase_views,
                    running=running,
                    waiting=waiting,
                    kv_cache_usage=kv_usage,
                    queue_share=share,
                    headroom=headroom(
                        self._headroom_limits,
                        device.memory_bandwidth_utilization,
                        device.compute_utilization,
                        kv_usage,
                        share,
                    ),
                    idle_cost_per_hour=cost.idle_per_hour if cost is not None else None,
                    kv_cache_capacity_tokens=self.kv_cache_capacity_tokens,
                    waiting_reason=self.window.waiting_reason(engine),
                    wait_shares=waits,
                    preemptions=preempted,
                    sequences_fit=fits.get(engine),
                )
            )
        return views
