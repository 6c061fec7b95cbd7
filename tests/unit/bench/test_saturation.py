import random

import pytest

from phasescope.bench.saturation import check_saturation, halves_ratio, mann_kendall_z
from phasescope.bench.workload import RequestRecord


def arrivals(count: int, rate: float, seed: int = 1) -> list[float]:
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(count):
        times.append(now)
        now += rng.expovariate(rate)
    return times


def request(index: int, sent: float, ttft: float, e2e: float) -> RequestRecord:
    """A request of 8 tokens: first at `ttft`, last at `e2e` after it was sent."""
    step = (e2e - ttft) / 7
    times = [sent + ttft + i * step for i in range(8)]
    return RequestRecord(index, sent, times, len(times), prompt_tokens=10, finished=times[-1])


def test_mann_kendall_sees_rising_falling_and_flat_series() -> None:
    assert mann_kendall_z(list(range(20))) > 5
    assert mann_kendall_z(list(range(20, 0, -1))) < -5
    assert mann_kendall_z([3.0] * 20) == 0.0
    noise = random.Random(7)
    assert abs(mann_kendall_z([noise.gauss(1.0, 0.2) for _ in range(40)])) < 2.326


def test_halves_ratio_compares_medians_and_never_divides_by_zero() -> None:
    assert halves_ratio([1, 1, 3, 3], floor=1e-3) == pytest.approx(3.0)
    assert halves_ratio([0, 0, 4, 4], floor=1.0) == pytest.approx(4.0)


def test_a_stable_server_is_not_flagged() -> None:
    # TTFT noise around 100 ms, E2E around 1 s, at 4 requests/s: in flight levels off near 4.
    noise = random.Random(3)
    records = [request(i, t, noise.uniform(0.08, 0.12), noise.uniform(0.9, 1.1))
               for i, t in enumerate(arrivals(40, 4.0))]  # fmt: skip
    check = check_saturation(records)
    assert check.evaluated
    assert not check.over_saturated, check.reasons


def test_the_ramp_before_the_steady_state_is_not_growth() -> None:
    # TTFT climbs while the batch fills (the first second), then stays flat: not over-saturated.
    noise = random.Random(4)
    times = arrivals(40, 4.0)
    records = [request(i, t, min(0.05 + 0.2 * t, 0.25) + noise.uniform(0, 0.02), 1.0) for i, t in enumerate(times)]
    assert not check_saturation(records).over_saturated


def test_ttft_growing_with_time_is_flagged() -> None:
    # A queue that grows: every request waits 0.1 s longer than the one before.
    records = [request(i, t, 0.1 + 0.1 * i, 1.0 + 0.1 * i) for i, t in enumerate(arrivals(30, 4.0))]
    check = check_saturation(records)
    assert check.over_saturated
    assert check.ttft_trend_z > 2.326
    assert check.ttft_growth_ratio >= 1.5
    assert any("TTFT grows" in reason for reason in check.reasons)


def test_requests_queueing_faster_than_they_finish_is_flagged() -> None:
    # Arrivals at 4/s, completions one every 0.5 s (2/s): the backlog grows by 2 requests a second.
    times = arrivals(40, 4.0, seed=5)
    records = [request(i, t, 0.1, max(0.5 * (i + 1) - t, 0.2)) for i, t in enumerate(times)]
    check = check_saturation(records)
    assert check.over_saturated
    assert check.backlog_z > 2.326
    assert check.backlog_growth >= 3
    assert any("queue faster than they finish" in reason for reason in check.reasons)


def test_a_closed_loop_point_keeps_a_constant_backlog() -> None:
    # Concurrency 4: each client sends its next request when the last ends.
    records, index = [], 0
    for client in range(4):
        sent = client * 0.01
        for _ in range(10):
            records.append(request(index, sent, 0.1, 1.0))
            sent, index = records[-1].finished, index + 1
    check = check_saturation(records)
    assert check.evaluated
    assert not check.over_saturated


def test_too_few_requests_after_the_ramp_are_not_judged() -> None:
    records = [request(i, t, 0.1 + i, 5.0 + i) for i, t in enumerate(arrivals(10, 4.0))]
    check = check_saturation(records)
    assert not check.evaluated
    assert not check.over_saturated
    assert check.requests_after_ramp < 8
