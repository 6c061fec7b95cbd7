import logging

import pytest

from phasescope.telemetry.request.phases import (
    KV_TRANSFER_PARAMS_KEY,
    EngineTimestamps,
    FrontendTimestamps,
    KvTransferFigures,
    PhaseRecord,
    derive_phase_timings,
)
from phasescope.telemetry.request.stages import ANSWERED, KV_TRANSFER
from phasescope.telemetry.step.interference import Interference

# Every reading is one monotonic clock (~1000 s); the wall clock is read once, at entry.
WALL_AT_ENTRY = 1.7e9


def front(entry: float, handed: float = 0.0, written: float = 0.0, ended: float = 0.0) -> FrontendTimestamps:
    return FrontendTimestamps(entry, WALL_AT_ENTRY, handed_to_engine=handed, first_chunk_written=written, ended=ended)


def stamps(queued: float, scheduled: float, first: float, last: float) -> EngineTimestamps:
    return EngineTimestamps(queued_ts=queued, scheduled_ts=scheduled, first_token_ts=first, last_token_ts=last)


def test_phases_follow_vllm_definitions_and_start_at_handler_entry() -> None:
    timings = derive_phase_timings(
        front(999.990, handed=999.995, written=1001.002), stamps(1000.0, 1000.5, 1001.0, 1003.0), 5
    )
    # Frontend = hand-off − handler entry; intake = engine arrival (queued) − hand-off.
    assert timings.frontend_seconds == pytest.approx(0.005)
    assert timings.intake_seconds == pytest.approx(0.005)
    assert timings.queue_seconds == pytest.approx(0.5)
    assert timings.prefill_seconds == pytest.approx(0.5)
    assert timings.decode_seconds == pytest.approx(2.0)
    # TTFT and E2E start at the handler's entry, on the same clock as the engine's stamps.
    assert timings.time_to_first_token_seconds == pytest.approx(1.01)
    assert timings.e2e_seconds == pytest.approx(3.01)
    # What the client waited: until its first chunk was written.
    assert timings.client_time_to_first_token_seconds == pytest.approx(1.012)
    # TPOT = decode / (output tokens - 1); the first token belongs to prefill.
    assert timings.mean_inter_token_seconds == pytest.approx(0.5)
    assert timings.decode_tokens_per_second == pytest.approx(2.0)
    assert timings.abandoned_seconds is None


def test_stages_tile_the_request_from_entry_to_last_token() -> None:
    entry, s = 99.5, stamps(100.0, 100.25, 101.125, 104.0)
    timings = derive_phase_timings(front(entry, handed=99.75), s, 10)
    stages = (
        timings.frontend_seconds,
        timings.intake_seconds,
        timings.queue_seconds,
        timings.prefill_seconds,
        timings.decode_seconds,
    )
    assert None not in stages
    assert sum(stage or 0.0 for stage in stages) == pytest.approx(s.last_token_ts - entry)
    assert timings.e2e_seconds == pytest.approx(s.last_token_ts - entry)


def test_single_token_has_no_decode_rate() -> None:
    timings = derive_phase_timings(front(9.9), stamps(10.0, 10.1, 10.2, 10.2), 1)
    assert timings.decode_seconds == 0.0
    assert timings.mean_inter_token_seconds is None
    assert timings.decode_tokens_per_second is None


def test_request_ended_before_its_first_token_is_abandoned_from_hand_off_to_end() -> None:
    # vLLM sends no stamps before the first token: the front end's own readings are all there is.
    timings = derive_phase_timings(front(9.9, handed=9.95, ended=11.2), None, 0)
    assert timings.frontend_seconds == pytest.approx(0.05)
    assert timings.abandoned_seconds == pytest.approx(1.25)
    assert timings.queue_seconds is None
    assert timings.prefill_seconds is None
    assert timings.time_to_first_token_seconds is None


def test_a_request_still_running_is_not_abandoned() -> None:
    assert derive_phase_timings(front(9.9, handed=9.95), None, 0).abandoned_seconds is None


def test_negative_interval_is_logged_and_left_out_never_zero(caplog: pytest.LogCaptureFixture) -> None:
    # Guards the defect of a stale start-up offset: a clock step clamped every TTFT to 0 silently.
    with caplog.at_level(logging.WARNING, logger="phasescope.telemetry.request.phases"):
        timings = derive_phase_timings(front(9.9, handed=10.05), stamps(10.0, 10.1, 10.3, 10.5), 3)
    assert timings.intake_seconds is None
    assert timings.frontend_seconds == pytest.approx(0.15)
    assert timings.queue_seconds == pytest.approx(0.1)
    assert "negative intake interval" in caplog.text


def test_wall_clock_of_a_reading_uses_the_requests_own_offset() -> None:
    assert front(100.0).wall(101.5) == pytest.approx(WALL_AT_ENTRY + 1.5)


def test_prefill_tokens_computed_excludes_prefix_cache_hits() -> None:
    timings = derive_phase_timings(front(0.5), stamps(1.0, 1.0, 2.0, 3.0), 2)
    record = PhaseRecord(
        "m",
        "OK",
        "stop",
        prompt_tokens=100,
        cached_prompt_tokens=64,
        completion_tokens=2,
        timings=timings,
        front=front(0.5),
    )
    assert record.prefill_tokens_computed == 36


def test_prefill_interference_is_reported_for_a_request_that_decoded_only() -> None:
    engine = EngineTimestamps(100.0, 100.1, 100.5, 102.5)
    timings = derive_phase_timings(front(99.9), engine, 20, Interference(stalled_seconds=0.4, extra_seconds=0.3))
    assert timings.decode_stalled_by_prefill_seconds == 0.4
    assert timings.decode_prefill_interference_seconds == 0.3
    # One token: no decode step to share with anyone.
    single = derive_phase_timings(front(99.9), EngineTimestamps(100.0, 100.1, 100.5, 100.5), 1, Interference(0.4, 0.3))
    assert single.decode_stalled_by_prefill_seconds is None
    assert single.decode_prefill_interference_seconds is None


def test_a_kv_transfer_is_its_own_stage_inside_prefill_with_the_tokens_and_bytes_moved() -> None:
    # A decode worker loaded 768 tokens' KV inside the step that first computed the request: 0.125 s of its
    # 0.5 s prefill. The stages that tile the request are unchanged; the transfer is inside one of them.
    transfer = KvTransferFigures(start=1000.6, seconds=0.125, loaded_tokens=768, saved_tokens=0, bytes=768 * 9216.0)
    engine = EngineTimestamps(1000.0, 1000.5, 1001.0, 1003.0, transfer=transfer)
    timings = derive_phase_timings(front(999.990, handed=999.995), engine, 5)
    assert timings.kv_transfer_seconds == pytest.approx(0.125)
    assert (timings.kv_loaded_tokens, timings.kv_saved_tokens, timings.kv_transfer_bytes) == (768, 0, 768 * 9216.0)
    assert timings.prefill_seconds == pytest.approx(0.5)
    tiled = sum(timings.seconds(stage) or 0.0 for stage in ANSWERED)
    assert tiled == pytest.approx(timings.e2e_seconds)
    assert KV_TRANSFER not in ANSWERED


def test_without_a_kv_transfer_there_is_no_stage_and_nothing_moved() -> None:
    nothing = KvTransferFigures(start=0.0, seconds=0.0, loaded_tokens=0, saved_tokens=0, bytes=0.0)
    for engine in (stamps(1000.0, 1000.5, 1001.0, 1003.0), EngineTimestamps(1000.0, 1000.5, 1001.0, 1003.0, nothing)):
        timings = derive_phase_timings(front(999.990, handed=999.995), engine, 5)
        assert timings.kv_transfer_seconds is None
        assert (timings.kv_loaded_tokens, timings.kv_saved_tokens, timings.kv_transfer_bytes) == (0, 0, 0.0)


def test_the_connectors_figures_come_out_of_the_params_the_client_sees() -> None:
    params = {
        "remote_host": "10.0.0.7",
        KV_TRANSFER_PARAMS_KEY: {
            "load_start": 0.0, "load_seconds": 0.0, "save_start": 50.25, "save_seconds": 0.5,
            "loaded_tokens": 0, "saved_tokens": 857, "bytes": 857 * 9216.0,
        },
    }  # fmt: skip
    rest, transfer = KvTransferFigures.from_params(params)
    assert rest == {"remote_host": "10.0.0.7"}
    assert transfer == KvTransferFigures(
        start=50.25, seconds=0.5, loaded_tokens=0, saved_tokens=857, bytes=857 * 9216.0
    )
    # Only phasescope's figures (the ExampleConnector answers nothing): no parameters for the client.
    assert KvTransferFigures.from_params({KV_TRANSFER_PARAMS_KEY: params[KV_TRANSFER_PARAMS_KEY]})[0] is None
    # Another worker's connector, or none: the parameters as they came.
    assert KvTransferFigures.from_params({"x": 1}) == ({"x": 1}, None)
    assert KvTransferFigures.from_params(None) == (None, None)
    # A load and a save add up; the stage begins where the first began.
    both = {**params[KV_TRANSFER_PARAMS_KEY], "load_start": 50.0, "load_seconds": 0.25}  # type: ignore[dict-item]
    _, transfer = KvTransferFigures.from_params({KV_TRANSFER_PARAMS_KEY: both})
    assert transfer is not None
    assert (transfer.start, transfer.seconds) == (50.0, 0.75)
