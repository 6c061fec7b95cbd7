"""The decision rules of phasescope.telemetry.step.verdict, one case per verdict, limit and price."""

import pytest

from phasescope.telemetry.step.verdict import (
    ROOF_ATTAINMENT_FOR_BOUND,
    HeadroomLimits,
    PhaseWork,
    headroom,
    host_overhead,
    phase_verdict,
    token_cost,
)

WINDOW = 10.0


def test_batch_one_decode_at_half_its_roof_is_host_bound_not_memory_bound() -> None:
    # The CPU case of docs/roofline.md: steps take 1 / 0.52 of what streaming the bytes needs.
    work = PhaseWork(busy_seconds=5.0, memory_seconds=2.6, compute_seconds=0.1, predicted_seconds=2.6)
    verdict = phase_verdict("decode", work, WINDOW, queue_share=0.0)
    assert verdict.verdict == "host"
    assert verdict.host_overhead == pytest.approx(0.48)


def test_decode_near_its_bandwidth_roof_is_memory_bound() -> None:
    work = PhaseWork(busy_seconds=5.0, memory_seconds=4.0, compute_seconds=0.5, predicted_seconds=4.0)
    assert phase_verdict("decode", work, WINDOW, 0.0).verdict == "memory"


def test_prefill_near_its_compute_roof_is_compute_bound() -> None:
    work = PhaseWork(busy_seconds=2.0, memory_seconds=0.2, compute_seconds=1.8, predicted_seconds=1.8)
    assert phase_verdict("prefill", work, WINDOW, 0.0).verdict == "compute"


def test_the_threshold_is_the_named_constant() -> None:
    at = PhaseWork(1.0, ROOF_ATTAINMENT_FOR_BOUND, 0.0, ROOF_ATTAINMENT_FOR_BOUND)
    below = PhaseWork(1.0, ROOF_ATTAINMENT_FOR_BOUND - 0.01, 0.0, ROOF_ATTAINMENT_FOR_BOUND - 0.01)
    assert phase_verdict("decode", at, WINDOW, 0.0).verdict == "memory"
    assert phase_verdict("decode", below, WINDOW, 0.0).verdict == "host"


def test_queued_requests_make_prefill_queue_bound_but_not_decode() -> None:
    work = PhaseWork(busy_seconds=2.0, memory_seconds=0.2, compute_seconds=1.8, predicted_seconds=1.8)
    assert phase_verdict("prefill", work, WINDOW, queue_share=0.6).verdict == "queue"
    assert phase_verdict("decode", work, WINDOW, queue_share=0.6).verdict == "compute"


def test_a_phase_that_barely_ran_is_idle_and_one_that_never_ran_has_no_overhead() -> None:
    little = PhaseWork(busy_seconds=0.05, memory_seconds=0.05, compute_seconds=0.0, predicted_seconds=0.05)
    assert phase_verdict("decode", little, WINDOW, 0.0).verdict == "idle"
    none = PhaseWork(0.0, 0.0, 0.0, 0.0)
    verdict = phase_verdict("decode", none, WINDOW, 0.0)
    assert (verdict.verdict, verdict.host_overhead) == ("idle", None)
    assert host_overhead(none) is None


def test_steps_faster_than_the_roof_read_no_overhead_not_a_negative_one() -> None:
    # Peaks set too low (a datasheet figure below what the part reaches): clipped at 0, never negative.
    assert host_overhead(PhaseWork(1.0, 1.2, 0.0, 1.2)) == 0.0


def test_headroom_is_the_nearest_limit_and_names_it() -> None:
    limits = HeadroomLimits(bandwidth=0.8, compute=0.7, kv_cache=0.9, queue=0.1)
    # Bandwidth 0.6 of 0.8 leaves 0.25; compute 0.07 of 0.7 leaves 0.9; KV 0.45 of 0.9 leaves 0.5; no queue.
    result = headroom(limits, bandwidth_utilization=0.6, compute_utilization=0.07, kv_cache_usage=0.45, queue_share=0)
    assert result.ratio == pytest.approx(0.25)
    assert result.limit == "bandwidth"
    assert result.each["kv_cache"] == pytest.approx(0.5)
    # Waiting 15 % of the time against a 10 % limit: no headroom, bound by the queue.
    full = headroom(limits, 0.1, 0.1, 0.1, queue_share=0.15)
    assert (full.ratio, full.limit) == (0.0, "queue")


def test_cost_per_million_tokens_splits_the_price_by_busy_time() -> None:
    # $3.60/hour for a 10 s window = $0.01. Busy 4 s in prefill, 4 s in decode: half each.
    # Prefill: $0.005 over 20,000 tokens = $0.25 per million; decode: $0.005 over 500 tokens = $10 per million.
    cost = token_cost(3.6, 10.0, {"prefill": 4.0, "decode": 4.0}, {"prefill": 20_000, "decode": 500}, 0.97)
    assert cost.per_million_tokens["prefill"] == pytest.approx(0.25)
    assert cost.per_million_tokens["decode"] == pytest.approx(10.0)
    # 97 % of the compute unused: $3.49 of the $3.60 hour pays for idle compute.
    assert cost.idle_per_hour == pytest.approx(3.492)


def test_no_busy_time_means_no_cost_per_token() -> None:
    cost = token_cost(2.0, 10.0, {"prefill": 0.0, "decode": 0.0}, {"prefill": 0, "decode": 0}, 1.0)
    assert cost.per_million_tokens == {}
    assert cost.idle_per_hour == 2.0
