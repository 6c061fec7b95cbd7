"""Request records for a server with no request path of its own: the engine core's, handed to the request observers.

Behind a front end phasescope does not run (smg's Rust request path, vLLM's OpenAI server), the only record of a
request is the one its engine core keeps (`EngineRequestRecord`: the engine's stamps and counts, derived from the
same outputs vLLM's front end reads). `EngineSideRequests` is a step sink that turns each into the calls a request
observer takes, so the same series are kept: the engine's stages (queue, prefill, decode) from the engine's stamps,
the prompt, cached and output tokens, each request by its finish reason. What only a front end knows is not
there: the frontend and intake stages, the time to first token and end-to-end latency a client saw (both start at
the front end's arrival), admission and rejections, trace context. Each request's `code` is what its finish reason
implies (stop and length: OK; abort: CANCELLED; error: INTERNAL); a stop string the front end matched reads as
`abort` here, since the front end ends such a request by aborting it in the engine.
"""

from __future__ import annotations

import asyncio
import threading

from phasescope.telemetry.request.observer import RequestObserver
from phasescope.telemetry.request.phases import (
    EngineTimestamps,
    FirstTokenRecord,
    FrontendTimestamps,
    PhaseRecord,
    derive_phase_timings,
)
from phasescope.telemetry.step.aggregator import StepSink
from phasescope.telemetry.step.records import EngineIteration, EngineRequestRecord

CODE_OF_FINISH = {"stop": "OK", "length": "OK", "abort": "CANCELLED", "error": "INTERNAL"}

# No front end: no entry, no hand-off (their stages are left out, not zero).
_NO_FRONT_END = FrontendTimestamps(entry=0.0, wall_at_entry=0.0)


class RecordClaims:
    """Engine records a front end waits for, by the id the engine core ran the request under: phasescope.v1 beside
    smg's Rust server reads its requests' engine stamps from them. Offered as the hub receives them, before the
    telemetry pipeline holds them (a response does not wait for a scrape). Thread-safe: a record is offered from
    the hub's thread, and the claimant's event loop is woken with it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future[EngineRequestRecord]]] = {}

    def claim(self, engine_request_id: str) -> asyncio.Future[EngineRequestRecord]:
        """The record of the request the engine runs as `engine_request_id`, once it comes (on the running loop;
        `release` it when no longer waited for)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[EngineRequestRecord] = loop.create_future()
        with self._lock:
            self._waiting[engine_request_id] = (loop, future)
        return future

    def release(self, engine_request_id: str) -> None:
        with self._lock:
            self._waiting.pop(engine_request_id, None)

    def offer(self, record: EngineRequestRecord) -> None:
        """A finished request's record: to its claimant, if it has one."""
        with self._lock:
            waiting = self._waiting.pop(record.request_id, None)
        if waiting is not None:
            loop, future = waiting
            loop.call_soon_threadsafe(_resolve, future, record)

    def __len__(self) -> int:
        with self._lock:
            return len(self._waiting)


def _resolve(future: asyncio.Future[EngineRequestRecord], record: EngineRequestRecord) -> None:
    if not future.done():
        future.set_result(record)


class EngineSideRequests(StepSink):
    """Each engine-side request record, and each output batch's tokens, as the request observers' calls (and to
    `claims`, the records a front end waits for)."""

    def __init__(self, model: str, observers: tuple[RequestObserver, ...], claims: RecordClaims | None = None) -> None:
        self._model = model
        self._observers = observers
        self._claims = claims

    def iteration(self, iteration: EngineIteration, at: float | None = None) -> None:
        if iteration.emitted_tokens:
            for observer in self._observers:
                observer.tokens_generated(self._model, iteration.emitted_tokens)

    def requests_finished(self, records: tuple[EngineRequestRecord, ...]) -> None:
        for record in records:
            self._finished(record)

    def _finished(self, record: EngineRequestRecord) -> None:
        model = self._model
        stamps = EngineTimestamps(record.queued_ts, record.scheduled_ts, record.first_token_ts, record.last_token_ts)
        timings = derive_phase_timings(_NO_FRONT_END, stamps, record.output_tokens)
        first_token = None
        if record.first_token_ts > 0.0:
            first_token = FirstTokenRecord(
                model=model,
                timings=timings,
                prefill_tokens_computed=max(0, record.prompt_tokens - record.cached_prompt_tokens),
                streaming=False,
                cached_prompt_tokens=record.cached_prompt_tokens,
            )
        finished = PhaseRecord(
            model=model,
            code=CODE_OF_FINISH.get(record.finish_reason, "INTERNAL"),
            finish_reason=record.finish_reason,
            prompt_tokens=record.prompt_tokens,
            cached_prompt_tokens=record.cached_prompt_tokens,
            completion_tokens=record.output_tokens,
            timings=timings,
            front=_NO_FRONT_END,
            stamps=stamps,
            streaming=False,
        )
        for observer in self._observers:
            observer.request_started(model)
            if first_token is not None:
                observer.request_first_token(first_token)
            observer.request_finished(finished)
