"""One request from handler entry to its end, whichever protocol it came in by.

A protocol handler parses its request into the engine's request model
(`phasescope.engine.request`), then runs it through the same hallway:

    async with path.begin(streaming, context) as request:
        engine = path.ready_engine()
        ...parse...
        async with request.admitted(path.caller(context)):
            ...tokenise, build sampling, engine.generate(...)...
            request.handed_to_engine(prompt_tokens, request_id, parameters, prompt_text)
            async for step in steps:
                request.took(step)
                yield <the protocol's chunk>
                request.chunk_written()

Each transition is a method; the first-token record and the phase record are emitted by
this object alone, each once: the first token when its chunk is written (or, if it never
is, when the request ends), the phase record when the `async with` ends. A refusal before
the hand-off is counted once, under the reason the status table gives it. Every reading
is `time.monotonic()`, the clock the engine stamps with (`phasescope.telemetry.request.phases`).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any, Protocol

import grpc

from phasescope.engine.base import Engine, EngineStep
from phasescope.engine.request import ParsedInput
from phasescope.errors import EngineUnavailableError, NotReadyError, PhasescopeError
from phasescope.serve.admission import Admission, Permit
from phasescope.serve.status import rejection_reason, status_for
from phasescope.telemetry.request.observer import RequestObserver
from phasescope.telemetry.request.phases import (
    EngineTimestamps,
    FirstTokenRecord,
    FrontendTimestamps,
    PhaseRecord,
    PhaseTimings,
    RequestParameters,
    RequestText,
    SampleRecord,
    derive_phase_timings,
)
from phasescope.telemetry.step.interference import NO_INTERFERENCE, Interference

ServicerContext = grpc.aio.ServicerContext[Any, Any]
# The client ended the request: it went away, or its deadline passed.
_CLIENT_ENDED = (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED)
# gRPC's deadline timer and the handler's reading of the remaining time disagree by a
# little: a cancellation this close to the deadline is the deadline.
_DEADLINE_SLACK_SECONDS = 0.05


class Deadlined(Protocol):
    """What the lifecycle reads of an RPC's context (grpc.aio's has it, whichever service)."""

    def time_remaining(self) -> float | None: ...


def _deadline_passed(context: Deadlined) -> bool:
    remaining = context.time_remaining()
    return remaining is not None and remaining <= _DEADLINE_SLACK_SECONDS


# An engine request id: this process's random half, then a count (32 hex digits, as a uuid4's hex).
_ID_PREFIX = os.urandom(8).hex()
_ID_COUNT = itertools.count()


def new_engine_request_id() -> str:
    """An id no other request of this server's engine has (client ids may collide: the engine's is always
    ours). A count behind a random prefix: unique as a uuid4, a tenth of its cost on every request's path."""
    return f"{_ID_PREFIX}{next(_ID_COUNT):016x}"


async def tokenize_off_loop(engine: Engine, parsed: ParsedInput) -> list[int]:
    """Token ids for the input; text is tokenised on a worker thread (vLLM's tokenizer is a
    thread-safe pool), so a long prompt does not stall every other stream on the event loop."""
    if parsed.kind == "token_ids":
        return list(parsed.token_ids)
    return await asyncio.to_thread(engine.tokenize, parsed)


class RequestPath:
    """What every request shares, whichever protocol it came in by: the engine, admission, the
    observers, the requests in flight (for WatchTelemetry) and the rejection count."""

    def __init__(
        self,
        observer: RequestObserver,
        admission: Admission,
        model_name: str,
        *,
        trace_id: Callable[[], str | None] = lambda: None,
        capture_text: bool = False,
        identify: Callable[[ServicerContext], str] = lambda context: "",
    ) -> None:
        """`trace_id` names the current trace for exemplars (tracing hands one in; the path
        never imports OpenTelemetry). `capture_text` puts prompt and output text in the record.
        `identify` names the caller for the per-client limit (phasescope.serve.auth.caller_identity)."""
        self.observer = observer
        self.admission = admission
        self.model_name = model_name
        self.trace_id = trace_id
        self.capture_text = capture_text
        self._identify = identify
        self.engine: Engine | None = None
        self.interference: Callable[[int], Interference] = lambda engine: NO_INTERFERENCE
        """An engine's running interference totals (the step aggregator's, once it exists)."""
        self.draining = False
        self.in_flight: set[RequestLifecycle] = set()
        """Admitted requests, from their permit to their end."""
        self.awaiting_first_chunk = 0
        """Requests between their handler's entry and their first chunk written (or their end without one)."""
        self.on_engine_dead: Callable[[], Awaitable[None]] = _nothing
        """Awaited when a request finds the engine dead, before its UNAVAILABLE leaves (the server turns health
        NOT_SERVING there, so no client hears of the death before the health service says so)."""

    def ready_engine(self) -> Engine:
        """The engine, or the reason no request can run now."""
        if self.draining:
            raise NotReadyError("the server is shutting down and takes no new requests")
        engine = self.engine
        if engine is None:
            raise NotReadyError("the engine is still starting; wait for the health service to say SERVING")
        if engine.is_dead:
            raise EngineUnavailableError("the engine is dead; the server must be restarted")
        return engine

    def caller(self, context: ServicerContext) -> str:
        """Who is asking, for the per-client limit (read only when that limit is on)."""
        return self._identify(context) if self.admission.per_client else ""

    def count_refusal(self, exc: BaseException | None) -> None:
        """The one place a refused request is counted, under the reason the status table gives it."""
        reason = rejection_reason(exc) if isinstance(exc, PhasescopeError) else None
        if reason is not None:
            self.observer.request_rejected(self.model_name, reason)

    @contextmanager
    def refusals(self) -> Iterator[None]:
        """Counts a request refused inside it (RPCs without a lifecycle, such as Tokenize)."""
        try:
            yield
        except PhasescopeError as exc:
            self.count_refusal(exc)
            raise

    def begin(self, streaming: bool, context: Deadlined) -> RequestLifecycle:
        """A request entering its handler now, on the RPC whose `context` tells a cancellation by the
        client from one by its deadline (gRPC cancels the handler either way)."""
        return RequestLifecycle(self, streaming, functools.partial(_deadline_passed, context))

    def waiting_for_first_token(self) -> bool:
        """Whether a request has entered its handler and has no first chunk written yet."""
        return self.awaiting_first_chunk > 0

    def first_chunk_settled(self) -> None:
        """A request has its first chunk, or ended without one. When none waits for a first token any more,
        the observers may hand on what they hold (`ObserverGroup.hand_on_soon`): a wave of records is observed
        after the next wave's first tokens are written, not while they are made."""
        self.awaiting_first_chunk -= 1
        if not self.awaiting_first_chunk:
            quiet = getattr(self.observer, "hand_on_soon", None)
            if quiet is not None:
                quiet()


async def _nothing() -> None:
    return None


# What a request not yet handed to the engine asked for, as far as its record says (a value: made once).
_NOT_YET_PARAMETERS = RequestParameters()
_FINISH_PRECEDENCE = {"abort": 0, "error": 1, "length": 2, "stop": 3}


class SampleProgress:
    """What one sample (one sequence in the engine) has produced so far; a request has one per sample."""

    __slots__ = (
        "_decode_start",
        "_totals",
        "cached_prompt_tokens",
        "completion_tokens",
        "finish_reason",
        "first_token_reported",
        "index",
        "stamps",
    )

    def __init__(self, index: int) -> None:
        self.index = index
        self.completion_tokens = 0
        self.cached_prompt_tokens = 0
        self.finish_reason: str | None = None
        self.stamps: EngineTimestamps | None = None
        # The engine's running totals at the first token, and at the latest step.
        self._decode_start: Interference | None = None
        self._totals = NO_INTERFERENCE
        self.first_token_reported = False

    def read_interference(self, totals: Interference) -> None:
        # The engine's totals advance in the output pass that delivered this step's tokens (its stat
        # logger runs before this request's consumer resumes): read at the first token and since,
        # their difference is what this sample's decode shared (phasescope.telemetry.step.interference).
        # Only the two readings are kept here, on the path of every token: their difference is taken when
        # it is read (`interference`), a few times per request, not at every mixed step of every request.
        if self._decode_start is None:
            self._decode_start = totals
        self._totals = totals

    @property
    def interference(self) -> Interference:
        """What other requests' prefill chunks have cost this sample's decode so far."""
        start, totals = self._decode_start, self._totals
        # The totals are replaced only by a mixed step: the same object is no interference since the start.
        if start is None or totals is start:
            return NO_INTERFERENCE
        return totals - start


class RequestLifecycle:
    """One request's transitions and what it has produced so far (no text kept unless captured).

    A request with n samples has n sequences in the engine, each with its own stamps and counts
    (`samples`); the request's own figures (`stamps`, `cached_prompt_tokens`) are the first sample's,
    and `completion_tokens` counts every sample's."""

    def __init__(self, path: RequestPath, streaming: bool, deadline_passed: Callable[[], bool]) -> None:
        self._path = path
        path.awaiting_first_chunk += 1
        self._awaiting = True
        self.streaming = streaming
        self._deadline_passed = deadline_passed
        self.front = FrontendTimestamps(entry=time.monotonic(), wall_at_entry=time.time())
        self.request_id = ""
        self.engine_request_id = ""
        self.prompt_tokens = 0
        self._first = SampleProgress(0)
        self.samples: list[SampleProgress] = [self._first]
        # The sample of the step just taken (whose chunk is written next).
        self._current = self._first
        self._parameters = _NOT_YET_PARAMETERS
        self._prompt_text = ""
        self._outputs: list[str] = []
        self._handed = False
        self._first_tokens_reported = 0
        # When the last chunk is built before any chunk was written, it is the client's first:
        # it is handed over at this reading, confirmed once it is written.
        self._handover = 0.0

    @property
    def completion_tokens(self) -> int:
        """Tokens generated so far, every sample's."""
        if len(self.samples) == 1:
            return self._first.completion_tokens
        return sum(sample.completion_tokens for sample in self.samples)

    @property
    def cached_prompt_tokens(self) -> int:
        return self._first.cached_prompt_tokens

    @property
    def stamps(self) -> EngineTimestamps | None:
        return self._first.stamps

    @property
    def interference(self) -> Interference:
        return self._first.interference

    @property
    def finish_reason(self) -> str | None:
        """The sample's, or with n samples the most telling: abort, else length, else stop."""
        reasons = [sample.finish_reason for sample in self.samples if sample.finish_reason is not None]
        return min(reasons, key=lambda reason: _FINISH_PRECEDENCE.get(reason, 1)) if reasons else None

    async def __aenter__(self) -> RequestLifecycle:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if isinstance(exc, EngineUnavailableError):
            await self._path.on_engine_dead()  # found dead before admission (no-op when already told)
        if self._handed:
            self._end(exc)
        else:
            # Refused (or failed) before the engine saw it: a rejection, not a request.
            self._path.count_refusal(exc)
        self._stop_waiting()

    def admitted(self, caller: str) -> Admitted:
        """Holds the request's permit, and lists it in flight, until the request ends."""
        return Admitted(self, self._path.admission.permit(caller))

    def handed_to_engine(
        self,
        prompt_tokens: int,
        request_id: str,
        parameters: RequestParameters,
        prompt_text: str,
        engine_request_id: str = "",
    ) -> None:
        """The engine has the request (`parameters.samples` sequences of it): from here on it is observed
        as a request, and ends with a record. `prompt_text` is what a record with text capture on carries
        (empty otherwise); `engine_request_id` is the engine's id for it (vLLM's logs name that one)."""
        front = self.front
        self.front = FrontendTimestamps(
            front.entry, front.wall_at_entry, time.monotonic(), front.first_chunk_written, front.ended
        )
        self.prompt_tokens = prompt_tokens
        self.request_id = request_id
        self.engine_request_id = engine_request_id or request_id
        self._parameters = parameters
        self._prompt_text = prompt_text
        if parameters.samples > 1:
            self.samples.extend(SampleProgress(index) for index in range(1, parameters.samples))
        self._handed = True
        self._path.observer.request_started(self._path.model_name)

    def took(self, step: EngineStep) -> None:
        """One engine step's output for this request (for one of its samples)."""
        sample = self.samples[step.index] if step.index else self._first
        self._current = sample
        before = sample.completion_tokens
        sample.completion_tokens = max(before, step.completion_tokens, before + len(step.token_ids))
        sample.cached_prompt_tokens = step.cached_prompt_tokens
        if step.finish_reason is not None:
            sample.finish_reason = step.finish_reason
        if step.stamps is not None:
            sample.stamps = step.stamps
            if step.stamps.first_token_ts > 0.0:
                sample.read_interference(self._path.interference(step.engine_index))
        if sample.completion_tokens > before:
            self._path.observer.tokens_generated(self._path.model_name, sample.completion_tokens - before)
        if self._path.capture_text and not step.index:
            self._outputs.append(step.text)

    def final_timings(self, sample: int = 0) -> PhaseTimings:
        """The timings a sample's last chunk carries. If no chunk was written before it, it is the client's
        first too, handed over now (its client TTFT ends here)."""
        front = self.front
        if not front.first_chunk_written:
            self._handover = time.monotonic()
            front = _written_at(front, self._handover)
        return _sample_timings(front, self.samples[sample])

    def chunk_written(self) -> None:
        """The chunk just produced reached the client (grpc.aio resumes a response generator once it
        has written the chunk). A stream's first one ends what its client waited for."""
        if not self.front.first_chunk_written and (self.streaming or self._handover):
            self.front = _written_at(self.front, self._handover or time.monotonic())
        self._report_first_token(self._current)
        if self._awaiting and self.front.first_chunk_written:
            self._stop_waiting()

    def _stop_waiting(self) -> None:
        """This request no longer waits for its first chunk (counted once, however it stopped)."""
        if self._awaiting:
            self._awaiting = False
            self._path.first_chunk_settled()

    def timings(self, sample: int = 0) -> PhaseTimings:
        return _sample_timings(self.front, self.samples[sample])

    def _report_first_token(self, sample: SampleProgress) -> None:
        if sample.first_token_reported or sample.stamps is None or sample.stamps.first_token_ts <= 0.0:
            return
        sample.first_token_reported = True
        path = self._path
        # What this moment knows is read now (the sample's figures so far, the current trace); the record is
        # built when it is delivered (`ObserverGroup.request_first_token_later`), like the end's.
        build = functools.partial(
            _first_token_record,
            path.model_name,
            self.front,
            sample.stamps,
            sample.completion_tokens,
            sample.interference,
            self.prompt_tokens,
            sample.cached_prompt_tokens,
            self.streaming,
            path.trace_id(),
            sample.index,
            self._first_tokens_reported == 0,
            self._parameters.constraint,
        )
        self._first_tokens_reported += 1
        later = getattr(path.observer, "request_first_token_later", None)
        if later is not None:
            later(build)
        else:
            path.observer.request_first_token(build())

    def _end(self, error: BaseException | None) -> None:
        front = self.front
        self.front = FrontendTimestamps(
            front.entry, front.wall_at_entry, front.handed_to_engine, front.first_chunk_written, time.monotonic()
        )
        # A first token came but its chunk never reached the client (cancelled while it was
        # written): its stages are still observed, once, without a client TTFT.
        for sample in self.samples:
            self._report_first_token(sample)
        code = grpc.StatusCode.OK if error is None else status_for(error)
        if code is grpc.StatusCode.CANCELLED and self._deadline_passed():
            code = grpc.StatusCode.DEADLINE_EXCEEDED
        path = self._path
        # What only this moment knows (the status, the current trace) is read now; the record itself is
        # built when it is delivered (`ObserverGroup.request_finished_later` holds it off this path).
        build = functools.partial(self._finished_record, code, error, path.trace_id())
        later = getattr(path.observer, "request_finished_later", None)
        if later is not None:
            later(build)
        else:
            path.observer.request_finished(build())

    def _finished_record(self, code: grpc.StatusCode, error: BaseException | None, trace_id: str | None) -> PhaseRecord:
        """The request's record once it has ended (nothing in it changes after `_end`)."""
        unfinished = "abort" if code in _CLIENT_ENDED else "error"
        path = self._path
        first = self._first
        return PhaseRecord(
            model=path.model_name,
            code=code.name,
            finish_reason=self.finish_reason or unfinished,
            prompt_tokens=self.prompt_tokens,
            cached_prompt_tokens=first.cached_prompt_tokens,
            completion_tokens=self.completion_tokens,
            timings=_sample_timings(self.front, first),
            front=self.front,
            stamps=first.stamps,
            streaming=self.streaming,
            parameters=self._parameters,
            error=error,
            trace_id=trace_id,
            text=RequestText(self._prompt_text, "".join(self._outputs)) if path.capture_text else None,
            samples=tuple(
                SampleRecord(
                    index=sample.index,
                    finish_reason=sample.finish_reason or unfinished,
                    completion_tokens=sample.completion_tokens,
                    cached_prompt_tokens=sample.cached_prompt_tokens,
                    timings=_sample_timings(self.front, sample),
                    stamps=sample.stamps,
                )
                for sample in self.samples
            )
            if len(self.samples) > 1
            else (),
        )


class Admitted:
    """A request's permit and its place in flight (`RequestLifecycle.admitted`). A class, not a generator-based
    context manager: entered on the path every request takes, for a third of the cost."""

    __slots__ = ("_permit", "_request")

    def __init__(self, request: RequestLifecycle, permit: Permit) -> None:
        self._request = request
        self._permit = permit

    async def __aenter__(self) -> None:
        await self._permit.__aenter__()  # refused here: nothing is held
        self._request._path.in_flight.add(self._request)

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        path = self._request._path
        if isinstance(exc, EngineUnavailableError):
            await path.on_engine_dead()  # while this request is still listed among those the engine ran
        path.in_flight.discard(self._request)
        await self._permit.__aexit__(exc_type, exc, traceback)


def _first_token_record(
    model: str,
    front: FrontendTimestamps,
    stamps: EngineTimestamps,
    completion_tokens: int,
    interference: Interference,
    prompt_tokens: int,
    cached_prompt_tokens: int,
    streaming: bool,
    trace_id: str | None,
    sample: int,
    request_first: bool,
    constraint: str,
) -> FirstTokenRecord:
    return FirstTokenRecord(
        model=model,
        timings=derive_phase_timings(front, stamps, completion_tokens, interference),
        prefill_tokens_computed=max(0, prompt_tokens - cached_prompt_tokens),
        cached_prompt_tokens=min(cached_prompt_tokens, prompt_tokens),
        streaming=streaming,
        trace_id=trace_id,
        sample=sample,
        request_first=request_first,
        constraint=constraint,
    )


def _written_at(front: FrontendTimestamps, written: float) -> FrontendTimestamps:
    # Made directly: `dataclasses.replace` costs twice as much, three times on every request's path.
    return FrontendTimestamps(front.entry, front.wall_at_entry, front.handed_to_engine, written, front.ended)


def _sample_timings(front: FrontendTimestamps, sample: SampleProgress) -> PhaseTimings:
    return derive_phase_timings(front, sample.stamps, sample.completion_tokens, sample.interference)
