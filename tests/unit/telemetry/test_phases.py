import pytest

from telemetry.phases import EngineTimestamps, PhaseRecord, derive_phase_timings

# Engine monotonic clock reads ~1000 s; wall clock = monotonic + 1.7e9.
OFFSET = 1.7e9


def stamps(arrival_mono: float, queued: float, scheduled: float, first: float, last: float) -> EngineTimestamps:
    return EngineTimestamps(
        arrival_time=arrival_mono + OFFSET,
        queued_ts=queued,
        scheduled_ts=scheduled,
        first_token_ts=first,
        last_token_ts=last,
    )


def test_phases_follow_vllm_definitions() -> None:
    timings = derive_phase_timings(stamps(999.990, 1000.0, 1000.5, 1001.0, 1003.0), 5, OFFSET)
    assert timings.queue_seconds == pytest.approx(0.5)
    assert timings.prefill_seconds == pytest.approx(0.5)
    assert timings.decode_seconds == pytest.approx(2.0)
    # TTFT and E2E start at the front end's arrival, converted onto the engine clock.
    assert timings.time_to_first_token_seconds == pytest.approx(1.01)
    assert timings.e2e_seconds == pytest.approx(3.01)
    # TPOT = decode / (output tokens - 1); the first token belongs to prefill.
    assert timings.mean_inter_token_seconds == pytest.approx(0.5)
    assert timings.decode_tokens_per_second == pytest.approx(2.0)


def test_phases_tile_the_engine_time_exactly() -> None:
    s = stamps(99.0, 100.0, 100.25, 101.125, 104.0)
    timings = derive_phase_timings(s, 10, OFFSET)
    assert timings.queue_seconds is not None
    assert timings.prefill_seconds is not None
    assert timings.decode_seconds is not None
    total = timings.queue_seconds + timings.prefill_seconds + timings.decode_seconds
    assert total == pytest.approx(s.last_token_ts - s.queued_ts)


def test_single_token_has_no_decode_rate() -> None:
    timings = derive_phase_timings(stamps(9.9, 10.0, 10.1, 10.2, 10.2), 1, OFFSET)
    assert timings.decode_seconds == 0.0
    assert timings.mean_inter_token_seconds is None
    assert timings.decode_tokens_per_second is None


def test_request_aborted_while_queued_has_only_what_it_reached() -> None:
    timings = derive_phase_timings(stamps(9.9, 10.0, 0.0, 0.0, 0.0), 0, OFFSET)
    assert timings.queue_seconds is None
    assert timings.prefill_seconds is None
    assert timings.decode_seconds is None
    assert timings.time_to_first_token_seconds is None


def test_clock_skew_never_gives_negative_durations() -> None:
    # Arrival converted with a slightly stale offset can land after queued_ts.
    timings = derive_phase_timings(stamps(10.002, 10.0, 10.1, 10.3, 10.5), 3, OFFSET)
    assert timings.queue_seconds == pytest.approx(0.1)
    assert timings.time_to_first_token_seconds == pytest.approx(0.298)


def test_prefill_tokens_computed_excludes_prefix_cache_hits() -> None:
    timings = derive_phase_timings(stamps(0.5, 1.0, 1.0, 2.0, 3.0), 2, OFFSET)
    record = PhaseRecord(
        "m", "OK", "stop", prompt_tokens=100, cached_prompt_tokens=64, completion_tokens=2, timings=timings
    )
    assert record.prefill_tokens_computed == 36
