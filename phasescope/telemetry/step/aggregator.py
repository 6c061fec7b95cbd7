"""The engine's steps, aggregated once for every reader: the window, the interference ledger, the views.

vLLM's v1 metrics keep the data (`stats.py`) apart from where it is sent (`loggers.py`); so does
this room. `StepAggregator` takes every report the engine makes (through
`records.StepForwarder`), attributes each step to the phases once, and keeps what every reader
asks of it: the window's figures, each engine's view with its verdicts, headroom and cost, and the
interference totals a request reads for its own decode. Sinks (the Prometheus export) are told of
each report with the attribution already made (`StepSink`, whose methods do nothing by default);
live readers (WatchTelemetry, `top`) and the Prometheus gauges read the views. Removing a sink
changes nothing else.

With a `pipeline` (phasescope.telemetry.pipeline) the reports wait there with the request records, each
stamped with its time, and `views` hands on what is held before it reads. The interference ledger is
updated at once: the requests whose tokens a step made read its totals next.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from phasescope.telemetry.hardware.peaks import HardwarePeaks
from phasescope.telemetry.model.adapter import NamedAdapter
from phasescope.telemetry.model.cost import ModelCost
from phasescope.telemetry.model.speculation import Drafter
from phasescope.telemetry.pipeline import TelemetryPipeline
from phasescope.telemetry.step.attribution import StepAttributor, StepCost
from phasescope.telemetry.step.interference import Interference, InterferenceLedger
from phasescope.telemetry.step.records import (
    PHASES,
    EngineIteration,
    EngineRequestRecord,
    PublisherHealth,
    SchedulerState,
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
from phasescope.telemetry.step.window import (
    DEFAULT_WINDOW_SECONDS,
    DeviceFigures,
    PhaseFigures,
    SpeculationFigures,
    StepWindow,
)


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
    """Why its waiting requests wait now (`window.WAIT_REASONS`), those waiting for an adapter slot apart."""
    waiting_for_adapters: int = 0
    """Of `waiting`, requests that wait for an adapter slot now (`max_loras` distinct adapters run already)."""
    wait_shares: dict[str, float] | None = None
    """The share of request time in the engine spent waiting, by reason, over the window."""
    preemptions: int = 0
    """Requests preempted for KV-cache blocks over the window."""
    sequences_fit: float | None = None
    """Sequences the cache holds at the window's mean context (None: nothing ran in the window)."""
    speculation: SpeculationFigures | None = None
    """Its verify steps' drafts over the window (None: no draft verified in the window)."""

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

    def queue(self, state: SchedulerState) -> None:
        """The engine's scheduler state at a stats update."""

    def publisher(self, health: PublisherHealth) -> None:
        """What watching has cost an engine core so far (its step publisher's cumulative figures)."""

    def requests_finished(self, records: tuple[EngineRequestRecord, ...]) -> None:
        """Requests the engine core saw end in a step (or aborted), as it recorded them."""


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
        pipeline: TelemetryPipeline | None = None,
        on_error: Callable[[str, BaseException], None] = lambda component, exc: None,
        drafter: Drafter | None = None,
        adapters: Mapping[int, NamedAdapter] | None = None,
    ) -> None:
        """`cost_per_hour` is each engine's price (None: no cost figures); `kv_cache_capacity_tokens` its KV
        cache's size (0: unknown). `pipeline`: where reports wait before they are aggregated (None: at once);
        a report that cannot be aggregated goes to `on_error` and costs that report only. `drafter`: what proposes
        the drafts under speculative decoding (None: off). `adapters`: the engine's LoRA adapters by their id in it,
        read as steps name them (kept up to date by the engine)."""
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
        self._sinks: tuple[StepSink, ...] = tuple(sinks)
        self._attributor: StepAttributor | None = None
        self._clock = clock
        self._pipeline = pipeline
        self._on_error = on_error
        self._drafter = drafter
        self.adapters: Mapping[int, NamedAdapter] = adapters if adapters is not None else {}

    def read_interference(self, engine: int) -> Interference:
        """An engine's running interference totals, for a request to difference over its decode."""
        return self.interference.read(engine)

    def _attribute(self, step: StepRecord) -> StepCost:
        # Made at the first step: a device with no peak FLOP/s for the dtype fails each step, not the start.
        if self._attributor is None:
            self._attributor = StepAttributor(
                self.cost,
                self.peak_memory_bandwidth_bytes_per_second,
                self.peak_flops,
                self._drafter,
                adapters=self.adapters,
            )
        return self._attributor(step)

    def add_sink(self, sink: StepSink) -> None:
        self._sinks = (*self._sinks, sink)

    @property
    def peak_memory_bandwidth_bytes_per_second(self) -> float:
        return self.peaks.memory_bandwidth_bytes_per_second

    @property
    def peak_flops(self) -> float:
        return self.peaks.peak_flops(self.dtype)

    def record(self, report: StepReport) -> None:
        """One stats update of the engine (`records.StepForwarder`): the ledger now, the rest when handed on."""
        step = report.step
        if step is not None:
            decode_share = 0.0
            if step.kind == "mixed" and not self.interference.has_reference(step.engine):
                # Before the engine's first decode-only step only: the step's roofline split stands in.
                decode_share = self._attribute(step).shares["decode"].seconds
            self.interference.record(step, decode_share)
        if self._pipeline is None:
            self._aggregate(report, self._clock())
        else:
            self._pipeline.hold(self._aggregate, report, self._clock())

    def hand_on(self) -> None:
        """Aggregate what waits in the pipeline (every reader calls this first)."""
        if self._pipeline is not None:
            self._pipeline.hand_on()

    def _aggregate(self, report: StepReport, at: float) -> None:
        """A report made at `at`."""
        try:
            self._aggregate_parts(report, at)
        except Exception as exc:
            self._on_error("step", exc)

    def _aggregate_parts(self, report: StepReport, at: float) -> None:
        if report.iteration is not None:
            iteration = report.iteration
            if iteration.preemptions:
                self.window.add_preemptions(iteration.engine, iteration.preemptions, at)
            for sink in self._sinks:
                sink.iteration(iteration, at)
        if report.scheduler is not None:
            state = report.scheduler
            self.window.add_queue(
                state.engine,
                state.running,
                state.waiting,
                state.kv_cache_usage,
                state.reason,
                at,
                waiting_for_adapters=state.waiting_for_adapters,
            )
            for sink in self._sinks:
                sink.queue(state)
        if report.publisher is not None:
            for sink in self._sinks:
                sink.publisher(report.publisher)
        if report.finished:
            for sink in self._sinks:
                sink.requests_finished(report.finished)
        if report.step is not None:
            cost = self._attribute(report.step)
            self.window.add(report.step, cost, at)
            for sink in self._sinks:
                sink.step(report.step, cost)

    def views(self) -> tuple[float, list[EngineView]]:
        """The window's length and, per engine, every figure with its verdicts, headroom and cost."""
        self.hand_on()
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
        speculation = self.window.speculation()
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
                    phase_verdict(
                        phase, work, length, share, waits.get("kv_cache", 0.0), preempted, waits.get("adapters", 0.0)
                    ),
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
                    waiting_for_adapters=self.window.waiting_for_adapters(engine),
                    wait_shares=waits,
                    preemptions=preempted,
                    sequences_fit=fits.get(engine),
                    speculation=speculation.get(engine),
                )
            )
        return views
