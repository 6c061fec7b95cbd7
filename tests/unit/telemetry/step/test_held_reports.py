"""The aggregator holding the engine's step reports (`batch_reports`): every reader sees what it would
have seen had each report been handed on as it came."""

from __future__ import annotations

import asyncio
import random

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from phasescope.telemetry.hardware.peaks import HardwarePeaks
from phasescope.telemetry.live import RecentLatencies
from phasescope.telemetry.model.cost import model_cost_from_config
from phasescope.telemetry.step.aggregator import StepAggregator, StepSink
from phasescope.telemetry.step.attribution import StepCost
from phasescope.telemetry.step.interference import Interference
from phasescope.telemetry.step.prometheus import StepMetrics
from phasescope.telemetry.step.records import EngineIteration, StepRecord, StepReport

PEAKS = HardwarePeaks("toy", 100e9, {"fp32": 1e12}, "measured", "toy device")
COST = model_cost_from_config(
    {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2},
    parameter_count=1_000_000,
    dtype="float32",
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def served(clock: FakeClock, batch: int) -> tuple[StepAggregator, CollectorRegistry, RecentLatencies]:
    recent = RecentLatencies(clock)
    aggregator = StepAggregator(
        COST, "float32", PEAKS, window_seconds=10.0, clock=clock, sinks=(recent,), batch_reports=batch
    )
    registry = CollectorRegistry()
    StepMetrics("m", aggregator, registry)
    return aggregator, registry, recent


def exposition(registry: CollectorRegistry) -> list[str]:
    """A scrape's lines, less the `_created` ones (wall-clock instants the server leaves out)."""
    return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]


def same_scrape(one: list[str], other: list[str]) -> bool:
    """The same series with the same values; a counter's value may differ in its last bits, as the export adds
    a hand-over's reports up before adding them to the counter (a different order of the same additions)."""
    if len(one) != len(other):
        return False
    for line, line_other in zip(one, other, strict=True):
        if line.startswith("#"):
            if line != line_other:
                return False
            continue
        series, value = line.rsplit(" ", 1)
        series_other, value_other = line_other.rsplit(" ", 1)
        if series != series_other or float(value) != pytest.approx(float(value_other), rel=1e-12):
            return False
    return True


QueueSample = tuple[int, int, float]
"""Running, waiting and KV-cache usage."""


def engine_reports(seed: int) -> list[tuple[float, StepRecord | EngineIteration | QueueSample]]:
    """A seeded run of an engine: decode and mixed steps, queue samples and output batches, each after a pause."""
    rng = random.Random(seed)
    reports: list[tuple[float, StepRecord | EngineIteration | QueueSample]] = []
    for _ in range(300):
        batch = rng.randint(1, 16)
        chunk = rng.choice([0, 0, 0, 200])
        gaps = tuple(rng.uniform(0.01, 0.05) for _ in range(batch))
        reports.append((rng.uniform(0.005, 0.08), EngineIteration(0, gaps, 0)))
        reports.append((0.0, (batch, rng.randint(0, 3), rng.uniform(0.0, 0.5))))
        reports.append((0.0, StepRecord(0, int(chunk > 0), chunk, batch, batch, rng.uniform(0.01, 0.06))))
    return reports


def report_to(aggregator: StepAggregator, report: StepRecord | EngineIteration | QueueSample) -> None:
    if isinstance(report, StepRecord):
        aggregator.record(report)
    elif isinstance(report, EngineIteration):
        aggregator.record_iteration(report)
    else:
        running, waiting, usage = report
        aggregator.record_queue(0, running, waiting, usage)


def test_held_reports_read_exactly_as_reports_handed_on_at_once() -> None:
    clocks = FakeClock(), FakeClock()
    at_once, held = served(clocks[0], 1), served(clocks[1], 96)
    interference: list[tuple[Interference, Interference]] = []
    for pause, report in engine_reports(seed=7):
        for clock in clocks:
            clock.now += pause
        report_to(at_once[0], report)
        report_to(held[0], report)
        # A request reads the interference totals at each of its steps: they never wait for a flush.
        interference.append((at_once[0].read_interference(0), held[0].read_interference(0)))
    assert all(a == b for a, b in interference)
    assert interference[-1][0].stalled_seconds > 0  # the run had mixed steps
    # The run ends with reports still held (300 steps make 900 reports, not a multiple of 96).
    # Readers hand them on first: the scrape (counters, gauges, verdicts), the views and the live latencies.
    assert same_scrape(exposition(held[1]), exposition(at_once[1]))
    assert held[0].views() == at_once[0].views()
    assert held[2].figures(5.0) == at_once[2].figures(5.0)


def test_a_report_held_long_counts_at_the_time_it_was_made() -> None:
    clock = FakeClock()
    aggregator, registry, recent = served(clock, 96)
    aggregator.record_iteration(EngineIteration(0, (0.02, 0.03), 0))
    aggregator.record(StepRecord(0, 0, 0, 2, 2, 0.05))
    # The engine goes quiet; the next reader comes after the window has passed.
    clock.now += 30.0
    _, views = aggregator.views()
    # The step is counted since start, but it is not in the window of the last 10 s, nor its gaps in the live view.
    assert (
        registry.get_sample_value("phasescope_engine_steps_total", {"model": "m", "engine": "0", "kind": "decode"}) == 1
    )
    assert views[0].phases["decode"].figures.tokens_per_second == 0
    assert recent.figures(10.0).inter_token_samples == 0
    assert recent.figures(60.0).inter_token_samples == 2


def exported_beside(
    sink: StepSink, failures: list[tuple[str, BaseException]], batch: int
) -> tuple[StepAggregator, CollectorRegistry]:
    """An aggregator with `sink` before the Prometheus export, its contained errors kept in `failures`."""
    aggregator = StepAggregator(
        COST,
        "float32",
        PEAKS,
        clock=FakeClock(),
        sinks=(sink,),
        batch_reports=batch,
        on_error=lambda where, exc: failures.append((where, exc)),
    )
    registry = CollectorRegistry()
    StepMetrics("m", aggregator, registry)
    return aggregator, registry


def test_a_held_report_that_fails_costs_that_report_only() -> None:
    failures: list[tuple[str, BaseException]] = []

    class Failing(StepSink):
        def step(self, step: StepRecord, cost: StepCost) -> None:
            if step.decode_requests == 3:
                raise RuntimeError("a sink's defect")

    aggregator, registry = exported_beside(Failing(), failures, batch=96)
    for batch in (2, 3, 2):
        aggregator.record(StepRecord(0, 0, 0, batch, batch, 0.05))
    exposition(registry)  # a scrape hands them on, and still answers
    assert [(where, str(exc)) for where, exc in failures] == [("step", "a sink's defect")]
    steps = {"model": "m", "engine": "0", "kind": "decode"}
    # The steps before and after it were handed on; the failing one stopped at the failing sink (the export
    # comes after it), as when each report is handed on at once.
    assert registry.get_sample_value("phasescope_engine_steps_total", steps) == 2


@pytest.mark.parametrize("batch", [0, 1])
def test_a_batch_of_one_or_less_hands_each_report_on_as_it_comes(batch: int) -> None:
    clock = FakeClock()
    aggregator, _, _ = served(clock, batch)
    aggregator.record(StepRecord(0, 0, 0, 2, 2, 0.05))
    assert len(aggregator.window._recent) == 1


def test_an_engine_step_handed_on_as_one_report_reads_as_its_parts_handed_on_one_by_one() -> None:
    # The stat logger hands each stats update on as one report (its output batch, scheduler state and step).
    clocks = FakeClock(), FakeClock()
    parts, whole = served(clocks[0], 96), served(clocks[1], 96)
    iteration: EngineIteration | None = None
    queue: QueueSample | None = None
    for pause, report in engine_reports(seed=11):
        for clock in clocks:
            clock.now += pause
        report_to(parts[0], report)
        if isinstance(report, EngineIteration):
            iteration = report
        elif isinstance(report, StepRecord):
            assert queue is not None
            whole[0].record_report(iteration, (0, *queue, 0, "other"), report)
            assert whole[0].read_interference(0) == parts[0].read_interference(0)
        else:
            queue = report
    assert same_scrape(exposition(whole[1]), exposition(parts[1]))
    assert whole[0].views() == parts[0].views()
    assert whole[2].figures(5.0) == parts[2].figures(5.0)


def test_a_report_built_when_handed_on_reads_as_one_built_when_it_came() -> None:
    # The stat logger takes only the ledger's entry as a step comes and builds its report with the held batch:
    # every reader, the interference each request reads at each step included, sees the same.
    clocks = FakeClock(), FakeClock()
    built_now, built_later = served(clocks[0], 96), served(clocks[1], 96)
    iteration: EngineIteration | None = None
    queue: QueueSample | None = None
    builds: list[int] = []

    def build(report: StepReport) -> StepReport:
        builds.append(1)
        return report

    for pause, report in engine_reports(seed=11):
        for clock in clocks:
            clock.now += pause
        if isinstance(report, EngineIteration):
            iteration = report
        elif isinstance(report, StepRecord):
            assert queue is not None
            whole: StepReport = (iteration, (0, *queue, 0, "other"), report)
            built_now[0].record_report(*whole)
            ledger = None
            if report.decode_tokens and report.decode_requests:
                ledger = (report.engine, report.decode_requests, report.kind == "mixed", report.elapsed_seconds)
            built_later[0].record_held(build, (whole,), ledger)
            assert built_later[0].read_interference(0) == built_now[0].read_interference(0)
        else:
            queue = report
    assert builds, "no report was built"
    assert same_scrape(exposition(built_later[1]), exposition(built_now[1]))
    assert built_later[0].views() == built_now[0].views()
    assert built_later[2].figures(5.0) == built_now[2].figures(5.0)


def test_a_report_that_cannot_be_built_costs_that_report_only() -> None:
    failures: list[tuple[str, BaseException]] = []
    aggregator, registry = exported_beside(StepSink(), failures, batch=2)

    def broken() -> StepReport:
        raise RuntimeError("vLLM's objects changed shape")

    aggregator.record_held(broken, (), (0, 2, False, 0.05))
    aggregator.record_report(None, (0, 2, 1, 0.5, 0, "slot"), StepRecord(0, 0, 0, 2, 2, 0.05))
    assert [where for where, _ in failures] == ["step"]
    assert (
        registry.get_sample_value("phasescope_engine_steps_total", {"model": "m", "engine": "0", "kind": "decode"}) == 1
    )


def test_a_part_of_one_report_that_fails_costs_that_part_only() -> None:
    failures: list[tuple[str, BaseException]] = []

    class Failing(StepSink):
        def iteration(self, iteration: EngineIteration, at: float | None = None) -> None:
            raise RuntimeError("a sink's defect")

    aggregator, registry = exported_beside(Failing(), failures, batch=1)
    aggregator.record_report(EngineIteration(0, (0.02,), 0), (0, 2, 1, 0.5, 0, "slot"), StepRecord(0, 0, 0, 2, 2, 0.05))
    assert [where for where, _ in failures] == ["step"]
    # The queue state and the step still count.
    assert (
        registry.get_sample_value("phasescope_engine_requests", {"model": "m", "engine": "0", "state": "waiting"}) == 1
    )
    assert (
        registry.get_sample_value("phasescope_engine_steps_total", {"model": "m", "engine": "0", "kind": "decode"}) == 1
    )


def test_on_the_event_loop_a_full_batch_is_handed_on_after_what_the_loop_has_ready() -> None:
    # vLLM's output handler fills a batch right after it woke the step's requests: their chunks go first.
    clock = FakeClock()
    aggregator, _, _ = served(clock, 2)
    seen: list[str] = []

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        loop.call_soon(lambda: seen.append(f"a request's chunk, {len(aggregator.window._recent)} steps handed on"))
        aggregator.record(StepRecord(0, 0, 0, 2, 2, 0.05))
        aggregator.record(StepRecord(0, 0, 0, 2, 2, 0.05))  # the batch is full
        aggregator.record(StepRecord(0, 0, 0, 2, 2, 0.05))  # one more before it ran: handed on with it, once
        seen.append(f"{len(aggregator.window._recent)} steps handed on in the output handler")
        await asyncio.sleep(0)
        seen.append(f"{len(aggregator.window._recent)} steps handed on once the loop ran")

    asyncio.run(scenario())
    assert seen == [
        "0 steps handed on in the output handler",
        "a request's chunk, 0 steps handed on",
        "3 steps handed on once the loop ran",
    ]
