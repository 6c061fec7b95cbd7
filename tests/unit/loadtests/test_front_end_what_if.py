"""`front_end_what_if`'s cuts: the names it refuses, the engine core's bounded blocking wait, and the timeline."""

from __future__ import annotations

import asyncio
import atexit
import sys
import time
from pathlib import Path

import pytest
import zmq
from vllm.distributed.device_communicators import shm_broadcast

from loadtests import front_end_what_if, wave_timeline
from phasescope.engine.base import EngineStep
from phasescope.engine.vllm.stats import HeldPrometheusStatLogger
from phasescope.serve.admission import Admission
from phasescope.serve.lifecycle import RequestLifecycle, RequestPath
from phasescope.telemetry.live import RecentLatencies
from phasescope.telemetry.request.observer import ObserverGroup
from phasescope.telemetry.request.phases import EngineTimestamps, RequestParameters
from phasescope.telemetry.step.aggregator import StepAggregator


def test_an_unknown_cut_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PHASESCOPE_WHAT_IF", "no-engine-mfu,no-such-cut")
    with pytest.raises(SystemExit, match="unknown no-such-cut"):
        front_end_what_if.apply_cuts()


def test_engine_core_blocks_changes_nothing_in_the_server_process(monkeypatch: pytest.MonkeyPatch) -> None:
    wait = shm_broadcast.SpinCondition.wait
    monkeypatch.setenv("PHASESCOPE_WHAT_IF", "engine-core-blocks")
    front_end_what_if.apply_cuts()
    assert shm_broadcast.SpinCondition.wait is wait


def test_a_blocked_reader_wakes_on_its_notification_and_never_waits_long_without_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(shm_broadcast.SpinCondition, "wait", shm_broadcast.SpinCondition.wait)
    front_end_what_if._engine_core_blocks()
    context = zmq.Context()
    try:
        writer = shm_broadcast.SpinCondition(False, context, "inproc://what-if-notify")
        reader = shm_broadcast.SpinCondition(True, context, "inproc://what-if-notify")
        reader.last_read = float("-inf")  # long idle: vLLM's own wait would block for the caller's whole timeout
        time.sleep(0.05)  # the subscription reaches the publisher
        # No notification (one lost, say): back within the 1 ms bound, not after the caller's timeout.
        start = time.monotonic()
        reader.wait(timeout_ms=5_000)
        assert time.monotonic() - start < 0.5
        # A notification is taken, so the next wait does not return on it again at once.
        writer.notify()  # type: ignore[no-untyped-call]  # vLLM leaves it unannotated
        time.sleep(0.05)
        reader.wait(timeout_ms=5_000)
        assert reader.local_notify_socket.poll(0) == 0
    finally:
        context.destroy(linger=0)


def test_switch_1ms_shortens_the_interpreters_switch_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    before = sys.getswitchinterval()
    monkeypatch.setenv("PHASESCOPE_WHAT_IF", "switch-1ms")
    try:
        front_end_what_if.apply_cuts()
        assert sys.getswitchinterval() == pytest.approx(0.001)
    finally:
        sys.setswitchinterval(before)


def test_the_timeline_keeps_each_request_s_moments_and_the_reader_finds_its_wave(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name in ("__init__", "handed_to_engine", "chunk_written", "__aexit__"):
        monkeypatch.setattr(RequestLifecycle, name, getattr(RequestLifecycle, name))  # put back after the test
    monkeypatch.setattr(ObserverGroup, "hand_on", ObserverGroup.hand_on)
    monkeypatch.setattr(StepAggregator, "flush_reports", StepAggregator.flush_reports)
    monkeypatch.setattr(HeldPrometheusStatLogger, "hand_on", HeldPrometheusStatLogger.hand_on)
    monkeypatch.setattr(front_end_what_if, "TIMELINE", [])
    monkeypatch.setenv("PHASESCOPE_WHAT_IF", "timeline")
    monkeypatch.setenv("PHASESCOPE_TIMELINE_FILE", str(tmp_path / "timeline.jsonl"))
    front_end_what_if.apply_cuts()
    atexit.unregister(front_end_what_if.write_timeline)
    records = ObserverGroup([RecentLatencies()], hold_seconds=60.0)
    path = RequestPath(records, Admission(64, 0), "tiny")

    async def one() -> None:
        async with path.begin(True, Context()) as request, request.admitted(""):
            await asyncio.sleep(0.001)
            request.handed_to_engine(5, "id", RequestParameters(max_tokens=1), "")
            now = time.monotonic()
            request.took(EngineStep("x", (1,), True, "length", 1, 0, EngineTimestamps(now, now, now, now)))
            request.chunk_written()

    async def wave() -> None:
        await asyncio.gather(*(one() for _ in range(40)))
        await asyncio.sleep(0.01)  # the records' hand-on, once no request waits for its first token

    asyncio.run(wave())
    front_end_what_if.write_timeline()
    requests, hand_ons = wave_timeline.read(tmp_path / "timeline.jsonl")
    assert len(requests) == 40
    assert all(list(request.times) == ["entry", "handed", "first", "end"] for request in requests)
    assert [len(each) for each in wave_timeline.waves(requests)] == [40]
    assert [hand_on.kind for hand_on in hand_ons] == ["records"]


class Context:
    def time_remaining(self) -> float | None:
        return None
