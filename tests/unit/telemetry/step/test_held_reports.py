"""The engine's step reports waiting in the telemetry pipeline: every reader sees what it would have seen had
each report been aggregated as it came."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from phasescope.telemetry.hardware.peaks import HardwarePeaks
from phasescope.telemetry.live import RecentLatencies
from phasescope.telemetry.model.cost import model_cost_from_config
from phasescope.telemetry.pipeline import TelemetryPipeline
from phasescope.telemetry.step.aggregator import StepAggregator, StepSink
from phasescope.telemetry.step.attribution import StepCost
from phasescope.telemetry.step.interference import Interference
from phasescope.telemetry.step.prometheus import StepMetrics
from phasescope.telemetry.step.records import EngineIteration, SchedulerState, StepRecord, StepReport

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


def served(clock: FakeClock, batch: int | None) -> tuple[StepAggregator, CollectorRegistry, RecentLatencies]:
    """An aggregator exported to a registry; its reports wait in a pipeline of `batch` (None: none)."""
    recent = RecentLatencies(clock)
    registry = CollectorRegistry()
    pipeline = None
    if batch is not None:
        pipeline = TelemetryPipeline(batch=batch)
        registry.register(pipeline.scrape_hook())
    aggregator = StepAggregator(
        COST, "float32", PEAKS, window_seconds=10.0, clock=clock, sinks=(recent,), pipeline=pipeline
    )
    step_metrics = StepMetrics("m", aggregator)
    aggregator.add_sink(step_metrics)
    registry.register(step_metrics)
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


def engine_reports(seed: int) -> list[tuple[float, StepReport]]:
    """A seeded run of an engine: decode and mixed steps with their output batches and queue states, each after
    a pause."""
    rng = random.Random(seed)
    reports: list[tuple[float, StepReport]] = []
    for _ in range(300):
        batch = rng.randint(1, 16)
        chunk = rng.choice([0, 0, 0, 200])
        gaps = tuple(rng.uniform(0.01, 0.05) for _ in range(batch))
        report = StepReport(
            iteration=EngineIteration(0, gaps, 0),
            scheduler=SchedulerState(0, batch, rng.randint(0, 3), rng.uniform(0.0, 0.5)),
            step=StepRecord(0, int(chunk > 0), chunk, batch, batch, rng.uniform(0.01, 0.06)),
        )
        reports.append((rng.uniform(0.005, 0.08), report))
    return reports


def test_held_reports_read_exactly_as_reports_aggregated_at_once() -> None:
    clocks = FakeClock(), FakeClock()
    at_once, held = served(clocks[0], None), served(clocks[1], 96)
    interference: list[tuple[Interference, Interference]] = []
    for pause, report in engine_reports(seed=7):
        for clock in clocks:
            clock.now += pause
        at_once[0].record(report)
        held[0].record(report)
        # A request reads the interference totals at each of its steps: they never wait in the pipeline.
        interference.append((at_once[0].read_interference(0), held[0].read_interference(0)))
    assert all(a == b for a, b in interference)
    assert interference[-1][0].stalled_seconds > 0  # the run had mixed steps
    # The run ends with reports still held (300 is not a multiple of 96). Readers hand them on first: the
    # scrape (counters, gauges, verdicts), the views; the live latencies once the views were read.
    assert same_scrape(exposition(held[1]), exposition(at_once[1]))
    assert held[0].views() == at_once[0].views()
    assert held[2].figures(5.0) == at_once[2].figures(5.0)


def test_a_report_held_long_counts_at_the_time_it_was_made() -> None:
    clock = FakeClock()
    aggregator, registry, recent = served(clock, 96)
    aggregator.record(StepReport(iteration=EngineIteration(0, (0.02, 0.03), 0), step=StepRecord(0, 0, 0, 2, 2, 0.05)))
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


def test_a_report_that_fails_costs_that_report_only() -> None:
    failures: list[tuple[str, BaseException]] = []

    class Failing(StepSink):
        def step(self, step: StepRecord, cost: StepCost) -> None:
            if step.decode_requests == 3:
                raise RuntimeError("a sink's defect")

    pipeline = TelemetryPipeline(batch=96)
    registry = CollectorRegistry()
    registry.register(pipeline.scrape_hook())
    aggregator = StepAggregator(
        COST, "float32", PEAKS, clock=FakeClock(), sinks=(Failing(),), pipeline=pipeline,
        on_error=lambda where, exc: failures.append((where, exc)),
    )  # fmt: skip
    step_metrics = StepMetrics("m", aggregator)
    aggregator.add_sink(step_metrics)
    registry.register(step_metrics)
    for batch in (2, 3, 2):
        aggregator.record(StepReport(step=StepRecord(0, 0, 0, batch, batch, 0.05)))
    exposition(registry)  # a scrape hands them on, and still answers
    assert [(where, str(exc)) for where, exc in failures] == [("step", "a sink's defect")]
    steps = {"model": "m", "engine": "0", "kind": "decode"}
    # The steps before and after it were aggregated; the failing one stopped at the failing sink.
    assert registry.get_sample_value("phasescope_engine_steps_total", steps) == 2
