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
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import replace
from types import TracebackType
from typing import Any, Protocol

import grpc

from phasescope.engine.base import Engine, EngineStep
from phasescope.engine.request import ParsedInput
from phasescope.errors import EngineUnavailableError, NotReadyError, PhasescopeError
from phasescope.serve.admission import Admission
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


class RequestLifecycle:
    """One request's transitions and what it has produced so far (no text kept unless captured)."""

    def __init__(self, path: RequestPath, streaming: bool, deadline_passed: Callable[[], bool]) -> None:
        self._path = path
        self.streaming = streaming
        self._deadline_passed = deadline_passed
        self.front = FrontendTimestamps(entry=time.monotonic(), wall_at_entry=time.time())
        self.request_id = ""
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_prompt_tokens = 0
        self.finish_reason: str | None = None
        self.stamps: EngineTimestamps | None = None
        self.interference = NO_INTERFERENCE
        """What other requests' prefill chunks have cost this request's decode so far."""
        # The engine's running totals at the first token, and at the latest step.
        self._decode_start: Interference | None = None
        self._totals = NO_INTERFERENCE
        self._parameters = RequestParameters()
        self._prompt_text = ""
        self._outputs: list[str] = []
        self._handed = False
        self._first_token_reported = False
        # When the last chunk is built before any chunk was written, it is the client's first:
        # it is handed over at this reading, confirmed once it is written.
        self._handover = 0.0

    async def __aenter__(self) -> RequestLifecycle:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if self._handed:
            self._end(exc)
        else:
            # Refused (or failed) before the engine saw it: a rejection, not a request.
            self._path.count_refusal(exc)

    @asynccontextmanager
    async def admitted(self, caller: str) -> AsyncIterator[None]:
        """Holds the request's permit, and lists it in flight, until the request ends."""
        path = self._path
        async with path.admission.permit(caller):
            path.in_flight.add(self)
            try:
                yield
            finally:
                path.in_flight.discard(self)

    def handed_to_engine(
        self, prompt_tokens: int, request_id: str, parameters: RequestParameters, prompt_text: str
    ) -> None:
        """The engine has the request: from here on it is observed as a request, and ends with a record.
        `prompt_text` is what a record with text capture on carries (empty otherwise)."""
        self.front = replace(self.front, handed_to_engine=time.monotonic())
        self.prompt_tokens = prompt_tokens
        self.request_id = request_id
        self._parameters = parameters
        self._prompt_text = prompt_text
        self._handed = True
        self._path.observer.request_started(self._path.model_name)

    def took(self, step: EngineStep) -> None:
        """One engine step's output for this request."""
        before = self.completion_tokens
        self.completion_tokens = max(before, step.completion_tokens, before + len(step.token_ids))
        self.cached_prompt_tokens = step.cached_prompt_tokens
        if step.finish_reason is not None:
            self.finish_reason = step.finish_reason
        if step.stamps is not None:
            self.stamps = step.stamps
            if step.stamps.first_token_ts > 0.0:
                self._read_interference(step.engine_index)
        if self.completion_tokens > before:
            self._path.observer.tokens_generated(self._path.model_name, self.completion_tokens - before)
        if self._path.capture_text:
            self._outputs.append(step.text)

    def _read_interference(self, engine: int) -> None:
        # The engine's totals advance in the output pass that delivered this step's tokens (its stat
        # logger runs before this request's consumer resumes): read at the first token and since,
        # their difference is what this request's decode shared (phasescope.telemetry.step.interference).
        totals = self._path.interference(engine)
        if self._decode_start is None:
            self._decode_start = totals
        elif totals is not self._totals:  # replaced only by a mixed step
            self.interference = totals - self._decode_start
        self._totals = totals

    def final_timings(self) -> PhaseTimings:
        """The timings the last chunk carries. If no chunk was written before it, it is the client's
        first too, handed over now (its client TTFT ends here)."""
        front = self.front
        if not front.first_chunk_written:
            self._handover = time.monotonic()
            front = replace(front, first_chunk_written=self._handover)
        return derive_phase_timings(front, self.stamps, self.completion_tokens, self.interference)

    def chunk_written(self) -> None:
        """The chunk just produced reached the client (grpc.aio resumes a response generator once it
        has written the chunk). A stream's first one ends what its client waited for."""
        if not self.front.first_chunk_written and (self.streaming or self._handover):
            self.front = replace(self.front, first_chunk_written=self._handover or time.monotonic())
        self._report_first_token()

    def timings(self) -> PhaseTimings:
        return derive_phase_timings(self.front, self.stamps, self.completion_tokens, self.interference)

    def _report_first_token(self) -> None:
        if self._first_token_reported or self.stamps is None or self.stamps.first_token_ts <= 0.0:
            return
        self._first_token_reported = True
        path = self._path
        path.observer.request_first_token(
            FirstTokenRecord(
                model=path.model_name,
                timings=self.timings(),
                prefill_tokens_computed=max(0, self.prompt_tokens - self.cached_prompt_tokens),
                streaming=self.streaming,
                trace_id=path.trace_id(),
            )
        )

    def _end(self, error: BaseException | None) -> None:
        self.front = replace(self.front, ended=time.monotonic())
        # The first token came but its chunk never reached the client (cancelled while it was
        # written): its stages are still observed, once, without a client TTFT.
        self._report_first_token()
        code = grpc.StatusCode.OK if error is None else status_for(error)
        if code is grpc.StatusCode.CANCELLED and self._deadline_passed():
            code = grpc.StatusCode.DEADLINE_EXCEEDED
        path = self._path
        path.observer.request_finished(
            PhaseRecord(
                model=path.model_name,
                code=code.name,
                finish_reason=self.finish_reason or ("abort" if code in _CLIENT_ENDED else "error"),
                prompt_tokens=self.prompt_tokens,
                cached_prompt_tokens=self.cached_prompt_tokens,
                completion_tokens=self.completion_tokens,
                timings=self.timings(),
                front=self.front,
                stamps=self.stamps,
                streaming=self.streaming,
                parameters=self._parameters,
                error=error,
                trace_id=path.trace_id(),
                text=RequestText(self._prompt_text, "".join(self._outputs)) if path.capture_text else None,
            )
        )
