"""The live view's sliding window and its percentiles (numpy's, as vLLM's `bench serve` reports them)."""

import pytest

from phasescope.telemetry.live import RecentLatencies, percentile
from phasescope.telemetry.step.records import EngineIteration


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_percentiles_interpolate_between_ranks() -> None:
    # Nearest rank would give 0.2 for p50 and 0.4 for p99: numpy interpolates linearly between the two closest.
    gaps = [0.4, 0.1, 0.3, 0.2]
    assert percentile(gaps, 50) == pytest.approx(0.25)
    assert percentile(gaps, 99) == pytest.approx(0.397)
    assert percentile(gaps, 0) == pytest.approx(0.1)
    assert percentile(gaps, 100) == pytest.approx(0.4)


def test_an_empty_window_reports_zero() -> None:
    assert percentile([], 99) == 0.0
    figures = RecentLatencies(Clock()).figures(window_seconds=10.0)
    assert (figures.inter_token_p99, figures.inter_token_samples, figures.decode_mean) == (0.0, 0, 0.0)


def test_the_window_keeps_only_its_last_seconds() -> None:
    clock = Clock()
    recent = RecentLatencies(clock)
    recent.iteration(EngineIteration(0, (5.0,), 0))
    clock.now += 20.0
    recent.iteration(EngineIteration(0, (0.4, 0.1, 0.3, 0.2), 0))
    figures = recent.figures(window_seconds=10.0)
    assert figures.inter_token_samples == 4
    assert figures.inter_token_p50 == pytest.approx(0.25)
    assert figures.inter_token_p99 == pytest.approx(0.397)


def test_a_busy_engine_keeps_at_most_the_cap_of_inter_token_gaps_dropping_the_oldest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import phasescope.telemetry.live as live

    monkeypatch.setattr(live, "MAX_OBSERVATIONS", 10)
    clock = Clock()
    recent = RecentLatencies(clock)
    recent.iteration(EngineIteration(0, (9.0,), 0, inter_token_counts=(6,)))  # the oldest step's gaps: dropped whole
    recent.iteration(EngineIteration(0, (), 0))  # a step with no decode keeps nothing
    recent.iteration(EngineIteration(0, (1.0,), 0, inter_token_counts=(4,)))
    recent.iteration(EngineIteration(0, (2.0, 3.0), 0, inter_token_counts=(3, 1)))
    figures = recent.figures(window_seconds=10.0)
    assert figures.inter_token_samples == 8
    assert figures.inter_token_p99 == pytest.approx(2.93)  # 1, 1, 1, 1, 2, 2, 2, 3
