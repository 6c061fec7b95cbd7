"""The request lifecycle: each transition once, each record once, whatever way the request ends."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable

import pytest

from phasescope.engine.base import EngineStep
from phasescope.errors import InvalidRequestError, OverloadedError
from phasescope.serve.admission import Admission
from phasescope.serve.lifecycle import RequestLifecycle
from phasescope.serve.path import Attached, RequestPath, new_engine_request_id
from phasescope.serve.watch import ServerFacts
from phasescope.telemetry.hardware.peaks import HardwarePeaks
from phasescope.telemetry.live import LatencyFigures
from phasescope.telemetry.pipeline import FirstTokenWaits, TelemetryPipeline
from phasescope.telemetry.request.observer import ObserverGroup
from phasescope.telemetry.request.phases import EngineTimestamps, FirstTokenRecord, PhaseRecord, RequestParameters
from phasescope.telemetry.step.aggregator import EngineView
from phasescope.telemetry.step.interference import Interference
from support.fake_engine import ScriptedEngine


class Recorder:
    """A RequestObserver that keeps every call."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.first_tokens: list[FirstTokenRecord] = []
        self.records: list[PhaseRecord] = []
        self.rejected: list[str] = []
        self.tokens = 0

    def request_started(self, model: str, adapter: str = "base") -> None:
        self.calls.append("started")

    def request_first_token(self, record: FirstTokenRecord) -> None:
        self.calls.append("first_token")
        self.first_tokens.append(record)

    def tokens_generated(self, model: str, count: int, adapter: str = "base") -> None:
        self.tokens += count

    def request_finished(self, record: PhaseRecord) -> None:
        self.calls.append("finished")
        self.records.append(record)

    def request_rejected(self, model: str, reason: str, adapter: str = "base") -> None:
        self.rejected.append(reason)


class Deadline:
    """The part of a gRPC servicer context the lifecycle reads: the time left before the deadline."""

    def __init__(self, passed: bool = False) -> None:
        self.passed = passed

    def time_remaining(self) -> float | None:
        return 0.0 if self.passed else None


def step(tokens: int, *, finished: bool = False, first_token: bool = True) -> EngineStep:
    # Stamped after the hand-off, as the engine would.
    now = time.monotonic()
    stamps = EngineTimestamps(
        queued_ts=now, scheduled_ts=now + 0.001, first_token_ts=now + 0.002 if first_token else 0.0,
        last_token_ts=now + 0.003,
    )  # fmt: skip
    return EngineStep(
        text="x",
        token_ids=(1,),
        finished=finished,
        finish_reason="length" if finished else None,
        completion_tokens=tokens,
        cached_prompt_tokens=2,
        stamps=stamps,
    )


def path(recorder: Recorder, capacity: int = 4) -> RequestPath:
    return RequestPath(recorder, Admission(capacity, 0), "tiny")


class NoFigures:
    """Engine-side figures nobody reads here."""

    def views(self) -> tuple[float, list[EngineView]]:
        return 0.0, []

    def latencies(self, window_seconds: float) -> LatencyFigures:
        raise AssertionError("no latencies are read here")

    @property
    def rejected(self) -> int:
        return 0


def attach(requests: RequestPath, interference: Callable[[int], Interference]) -> None:
    """A scripted engine attached, its interference totals read from `interference`."""
    engine = ScriptedEngine()
    facts = ServerFacts("tiny", "cpu", "float32", HardwarePeaks("cpu", 1e10, {"fp32": 1e11}, "flag"), 0.0)
    requests.attach(Attached(engine, interference, facts, NoFigures()))


def hand(request: RequestLifecycle) -> None:
    request.handed_to_engine(5, "id-1", "engine-1", RequestParameters(max_tokens=3))


async def test_a_refusal_before_the_hand_off_is_counted_once_and_is_no_request() -> None:
    recorder = Recorder()
    requests = path(recorder)
    with pytest.raises(InvalidRequestError):
        async with requests.begin(True, Deadline()):
            raise InvalidRequestError("sampling.top_p", "must be in (0, 1], got 1.5")
    assert recorder.rejected == ["invalid_argument"]
    assert recorder.calls == []


async def test_a_full_server_refuses_at_the_permit_and_counts_it_overloaded() -> None:
    recorder = Recorder()
    requests = path(recorder, capacity=1)
    async with requests.begin(True, Deadline()) as first, first.admitted(""):
        with pytest.raises(OverloadedError):
            async with requests.begin(True, Deadline()) as second, second.admitted(""):
                pass
        assert requests.in_flight == {first}
    assert recorder.rejected == ["overloaded"]
    assert requests.in_flight == set()
    assert requests.admission.in_flight == 0


async def test_each_record_is_emitted_once_in_order() -> None:
    recorder = Recorder()
    requests = path(recorder)
    async with requests.begin(True, Deadline()) as request, request.admitted(""):
        hand(request)
        for tokens in (1, 2):
            request.took(step(tokens))
            request.chunk_written()
        request.took(step(3, finished=True))
        request.final_timings()
        request.chunk_written()
    assert recorder.calls == ["started", "first_token", "finished"]
    assert recorder.tokens == 3
    (record,) = recorder.records
    assert (record.code, record.finish_reason, record.completion_tokens, record.prompt_tokens) == ("OK", "length", 3, 5)
    # The first token's record went out when its chunk was written: the client's wait is known.
    assert recorder.first_tokens[0].timings.client_time_to_first_token_seconds is not None
    assert recorder.first_tokens[0].prefill_tokens_computed == 3


async def cancel(requests: RequestPath, *, deadline_passed: bool, steps: int) -> None:
    """A stream handed to the engine, cancelled after `steps` steps (before any chunk was written)."""

    async def cancelled() -> None:
        async with requests.begin(True, Deadline(passed=deadline_passed)) as request, request.admitted(""):
            hand(request)
            for tokens in range(1, steps + 1):
                request.took(step(tokens))
            raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        await cancelled()


async def test_a_first_token_whose_chunk_never_reached_the_client_is_still_reported_once() -> None:
    recorder = Recorder()
    requests = path(recorder)
    await cancel(requests, deadline_passed=False, steps=1)  # cancelled while its first chunk was written
    assert recorder.calls == ["started", "first_token", "finished"]
    assert recorder.first_tokens[0].timings.client_time_to_first_token_seconds is None
    assert (recorder.records[0].code, recorder.records[0].finish_reason) == ("CANCELLED", "abort")
    assert requests.admission.in_flight == 0


async def test_a_cancellation_at_the_deadline_is_recorded_as_the_deadline() -> None:
    recorder = Recorder()
    await cancel(path(recorder), deadline_passed=True, steps=0)
    assert recorder.records[0].code == "DEADLINE_EXCEEDED"
    assert not recorder.records[0].produced_first_token


async def test_a_unary_answer_reaches_its_client_with_the_last_chunk_not_the_first() -> None:
    recorder = Recorder()
    requests = path(recorder)
    async with requests.begin(False, Deadline()) as request, request.admitted(""):
        hand(request)
        request.took(step(1))
        request.chunk_written()
        first_written = request.front.first_chunk_written
        await asyncio.sleep(0.01)
        request.took(step(2, finished=True))
        handed_over = request.final_timings().client_time_to_first_token_seconds
        request.chunk_written()
    assert first_written == 0.0
    assert handed_over is not None
    assert recorder.records[0].timings.client_time_to_first_token_seconds == pytest.approx(handed_over)


async def test_text_is_kept_only_when_capture_is_on() -> None:
    for capture in (False, True):
        recorder = Recorder()
        requests = RequestPath(recorder, Admission(1, 0), "tiny", capture_text=capture)
        async with requests.begin(True, Deadline()) as request, request.admitted(""):
            request.handed_to_engine(5, "id", "engine-id", RequestParameters(), "the prompt" if capture else "")
            request.took(step(1, finished=True))
        text = recorder.records[0].text
        assert (text is not None) is capture
        if text is not None:
            assert (text.prompt, text.output) == ("the prompt", "x")


def test_engine_request_ids_never_repeat_and_read_as_a_uuid_s_hex() -> None:
    ids = [new_engine_request_id() for _ in range(10_000)]
    assert len(set(ids)) == len(ids)
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)


async def test_records_wait_while_a_request_waits_for_its_first_token_and_are_handed_on_once_none_does() -> None:
    recorder = Recorder()
    waits = FirstTokenWaits()
    pipeline = TelemetryPipeline(waits, batch=1)
    requests = RequestPath(ObserverGroup(batched=[recorder], pipeline=pipeline), Admission(4, 0), "tiny",
                           first_token_waits=waits)  # fmt: skip
    async with requests.begin(True, Deadline()) as first, first.admitted(""):
        hand(first)
        waiting = requests.begin(True, Deadline())  # the next request, not yet at its first chunk
        async with waiting, waiting.admitted(""):
            first.took(step(1, finished=True))
            first.final_timings()
            first.chunk_written()
            await asyncio.sleep(0.01)
            # The first request's first token waits: another still waits for its own.
            assert recorder.calls == ["started"]
            hand(waiting)
            waiting.took(step(1))
            waiting.chunk_written()
            assert requests.first_token_waits.count == 0
            # Handed on once the loop has looked again (every 2 ms), with none waiting.
            await asyncio.sleep(0.01)
            assert recorder.calls == ["started", "started", "first_token", "first_token"]
            waiting.took(step(2, finished=True))
            waiting.final_timings()
            waiting.chunk_written()
    await asyncio.sleep(0.01)
    assert recorder.calls == ["started", "started", "first_token", "first_token", "finished", "finished"]
    assert [record.timings.client_time_to_first_token_seconds is not None for record in recorder.first_tokens] == [
        True,
        True,
    ]


async def test_a_reader_gets_what_waits_at_once() -> None:
    recorder = Recorder()
    pipeline = TelemetryPipeline(batch=1000)
    group = ObserverGroup(batched=[recorder], pipeline=pipeline)
    group.request_rejected("tiny", "overloaded")  # not a record: at once
    assert recorder.rejected == ["overloaded"]
    requests = RequestPath(group, Admission(1, 0), "tiny")
    await cancel(requests, deadline_passed=False, steps=1)
    assert recorder.calls == ["started"]
    assert pipeline.held == 2
    pipeline.hand_on()
    assert recorder.calls == ["started", "first_token", "finished"]


async def test_every_way_a_request_ends_stops_it_waiting_for_a_first_token() -> None:
    recorder = Recorder()
    requests = path(recorder, capacity=1)
    with pytest.raises(InvalidRequestError):
        async with requests.begin(True, Deadline()):
            raise InvalidRequestError("sampling.top_p", "must be in (0, 1], got 1.5")
    async with requests.begin(True, Deadline()) as request, request.admitted(""):
        with pytest.raises(OverloadedError):
            async with requests.begin(True, Deadline()) as refused, refused.admitted(""):
                pass
        assert requests.first_token_waits.count == 1
    await cancel(requests, deadline_passed=False, steps=1)
    await cancel(requests, deadline_passed=True, steps=0)
    async with requests.begin(False, Deadline()) as unary, unary.admitted(""):
        hand(unary)
        unary.took(step(1, finished=True))
        unary.final_timings()
        unary.chunk_written()
        assert requests.first_token_waits.count == 0
    assert requests.first_token_waits.count == 0


async def test_an_engine_that_stamps_only_at_the_end_has_its_decode_interference_read_from_its_first_token() -> None:
    # Beside smg's Rust server the engine stamps arrive with the request's end: the interference the decode shared
    # is still what the engine's totals moved between the sample's first token and its end.
    totals = iter([Interference(stalled_seconds=1.0, extra_seconds=0.5), Interference(3.0, 1.25)])
    requests = path(Recorder())
    attach(requests, lambda engine: next(totals))
    async with requests.begin(True, Deadline()) as request, request.admitted(""):
        hand(request)
        request.took(dataclasses.replace(step(1), stamps=None))
        request.took(dataclasses.replace(step(3, finished=True), token_ids=()))
    timings = request.timings()
    assert timings.decode_stalled_by_prefill_seconds == pytest.approx(2.0)
    assert timings.decode_prefill_interference_seconds == pytest.approx(0.75)


async def test_the_interference_source_wired_into_the_path_later_is_the_one_its_requests_read() -> None:
    # The server attaches the engine's step aggregator to a path already built (Built.attach_engine).
    requests = path(Recorder())
    async with requests.begin(True, Deadline()) as request, request.admitted(""):
        hand(request)
        totals = iter([Interference(1.0, 0.5), Interference(3.0, 1.25)])
        attach(requests, lambda engine: next(totals))
        request.took(step(1))
        request.took(step(2, finished=True))
    assert request.interference == Interference(2.0, 0.75)


def test_an_engine_is_attached_to_a_path_once() -> None:
    requests = path(Recorder())
    attach(requests, lambda engine: Interference())
    with pytest.raises(RuntimeError, match="already attached"):
        attach(requests, lambda engine: Interference())
