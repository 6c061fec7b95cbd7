"""One request's transitions, from its handler's entry to its end (the request path walks it: `path.py`).

The lifecycle knows nothing of the path: what it reads of what every request shares is a `LifecycleDeps` the path
builds once and hands to each request (the observer, the model's name, the first-token waits, the engine's
interference totals, the current trace's id, whether text is captured, admission and the set of requests in flight,
and the two things it tells the path: a refusal, and a dead engine).

Each transition is a method; the first-token and phase records are emitted by this object alone, each once:
a sample's first token when its chunk is written (or, if it never is, when the request ends), the phase
record when the request ends. A refusal before the hand-off is counted once, under the reason the status
table gives it. Every reading is `time.monotonic()`, the clock the engine stamps with
(`phasescope.telemetry.request.phases`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from types import TracebackType

import grpc

from phasescope.engine.base import EngineStep
from phasescope.errors import EngineUnavailableError
from phasescope.serve.admission import Admission
from phasescope.serve.status import status_for
from phasescope.telemetry.pipeline import FirstTokenWaits
from phasescope.telemetry.request.adapters import BASE_ADAPTER
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

# The client ended the request: it went away, or its deadline passed.
_CLIENT_ENDED = (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED)
_FINISH_PRECEDENCE = {"abort": 0, "error": 1, "length": 2, "stop": 3}


@dataclass(frozen=True, slots=True)
class LifecycleDeps:
    """What a request's lifecycle uses of what every request shares (the request path builds one for all)."""

    observer: RequestObserver
    model_name: str
    first_token_waits: FirstTokenWaits
    interference: Callable[[int], Interference]
    """An engine's running interference totals, read when asked: the source may be wired in after the requests
    began (the step aggregator's, once the engine is attached)."""
    trace_id: Callable[[], str | None]
    capture_text: bool
    admission: Admission
    in_flight: set[RequestLifecycle]
    """Admitted requests, from their permit to their end."""
    count_refusal: Callable[[BaseException | None, str], None]
    """Counts a request refused before the hand-off (with its adapter label), under the reason the status table
    gives it."""
    engine_died: Callable[[], Awaitable[None]]
    """A request found the engine dead."""


class SampleProgress:
    """What one sample (one sequence in the engine) has produced so far; a request has one per sample."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.completion_tokens = 0
        self.cached_prompt_tokens = 0
        self.finish_reason: str | None = None
        self.stamps: EngineTimestamps | None = None
        self.drafted_tokens = 0
        self.accepted_tokens = 0
        # The engine's interference totals at the sample's first token, and at its latest step.
        self._decode_start: Interference | None = None
        self._totals = NO_INTERFERENCE
        self.first_token_reported = False

    def read_interference(self, totals: Interference) -> None:
        # The engine's totals advance with each step's report, which the engine core publishes before it sends the
        # step's outputs (the hub usually hands it on before this request's consumer resumes, else a step later, at
        # both ends of the decode alike): their difference since the first token is what this sample's decode shared
        # (phasescope.telemetry.step.interference).
        if self._decode_start is None:
            self._decode_start = totals
        self._totals = totals

    @property
    def interference(self) -> Interference:
        """What other requests' prefill chunks have cost this sample's decode so far."""
        if self._decode_start is None:
            return NO_INTERFERENCE
        return self._totals - self._decode_start


class RequestLifecycle:
    """One request's transitions and what it has produced so far (no text kept unless captured).

    A request with n samples has n sequences in the engine, each with its own stamps and counts
    (`samples`); the request's own figures (`stamps`, `cached_prompt_tokens`) are the first sample's,
    and `completion_tokens` counts every sample's."""

    def __init__(self, deps: LifecycleDeps, streaming: bool, deadline_passed: Callable[[], bool]) -> None:
        self._deps = deps
        deps.first_token_waits.started()
        self._awaiting = True
        self.streaming = streaming
        self._deadline_passed = deadline_passed
        self.front = FrontendTimestamps(entry=time.monotonic(), wall_at_entry=time.time())
        self.request_id = ""
        """The client's id for it (or the engine's, when it sent none)."""
        self.engine_request_id = ""
        self.abortable = False
        """Whether an engine-protocol `Abort` naming `request_id` stops it."""
        self.prompt_tokens = 0
        self.adapter = BASE_ADAPTER
        """The adapter label its series carry (phasescope.telemetry.request.adapters), once it is decoded."""
        self._first = SampleProgress(0)
        self.samples: list[SampleProgress] = [self._first]
        # The sample of the step just taken (whose chunk is written next).
        self._current = self._first
        self._parameters = RequestParameters()
        self._prompt_text = ""
        self._outputs: list[str] = []
        self._handed = False
        self._first_tokens_reported = 0
        # When the last chunk is built before any chunk was written, it is the client's first: it is handed
        # over at this reading, confirmed once it is written.
        self._handover = 0.0

    @property
    def adapter_name(self) -> str:
        """The LoRA adapter it runs with, as asked ("": the base model); `adapter` is its series label."""
        return self._parameters.adapter

    @property
    def completion_tokens(self) -> int:
        """Tokens generated so far, every sample's."""
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
            await self._deps.engine_died()  # found dead before admission (once told, a no-op)
        if self._handed:
            self._end(exc)
        else:
            # Refused (or failed) before the engine saw it: a rejection, not a request.
            self._deps.count_refusal(exc, self.adapter)
        self._stop_waiting()

    @asynccontextmanager
    async def admitted(self, caller: str) -> AsyncIterator[None]:
        """Holds the request's permit, and lists it in flight, until the request ends."""
        deps = self._deps
        async with deps.admission.permit(caller):
            deps.in_flight.add(self)
            try:
                yield
            except EngineUnavailableError:
                await deps.engine_died()  # while this request is still listed among those the engine ran
                raise
            finally:
                deps.in_flight.discard(self)

    def handed_to_engine(
        self,
        prompt_tokens: int,
        request_id: str,
        engine_request_id: str,
        parameters: RequestParameters,
        prompt_text: str = "",
        *,
        abortable: bool = False,
    ) -> None:
        """The engine has the request (`parameters.samples` sequences of it): from here on it is observed as a
        request, and ends with a record. `prompt_text` is what a record with text capture on carries."""
        self.front = dataclasses.replace(self.front, handed_to_engine=time.monotonic())
        self.prompt_tokens = prompt_tokens
        self.request_id = request_id
        self.engine_request_id = engine_request_id
        self.abortable = abortable
        self._parameters = parameters
        self._prompt_text = prompt_text
        self.samples.extend(SampleProgress(index) for index in range(1, parameters.samples))
        self._handed = True
        self._deps.observer.request_started(self._deps.model_name, self.adapter)

    def took(self, step: EngineStep) -> None:
        """One engine step's output for this request (for one of its samples)."""
        sample = self.samples[step.index]
        self._current = sample
        before = sample.completion_tokens
        sample.completion_tokens = max(before, step.completion_tokens, before + len(step.token_ids))
        sample.cached_prompt_tokens = step.cached_prompt_tokens
        if step.finish_reason is not None:
            sample.finish_reason = step.finish_reason
        if step.drafted_tokens:
            sample.drafted_tokens, sample.accepted_tokens = step.drafted_tokens, step.accepted_tokens
        if step.stamps is not None:
            sample.stamps = step.stamps
        if step.token_ids or (step.stamps is not None and step.stamps.first_token_ts > 0.0):
            # From the sample's first token on (an engine that sends its stamps only at the end, smg's Rust server,
            # has its first token read here all the same).
            sample.read_interference(self._deps.interference(step.engine_index))
        if sample.completion_tokens > before:
            self._deps.observer.tokens_generated(self._deps.model_name, sample.completion_tokens - before, self.adapter)
        if self._deps.capture_text and not step.index:
            self._outputs.append(step.text)

    def final_timings(self, sample: int = 0) -> PhaseTimings:
        """The timings a sample's last chunk carries. If no chunk was written before it, it is the client's
        first too, handed over now (its client TTFT ends here)."""
        front = self.front
        if not front.first_chunk_written:
            self._handover = time.monotonic()
            front = dataclasses.replace(front, first_chunk_written=self._handover)
        return _sample_timings(front, self.samples[sample])

    def chunk_written(self) -> None:
        """What the last step produced reached the client (grpc.aio resumes a response generator once it has
        written what it yielded). A stream's first chunk ends what its client waited for."""
        if not self.front.first_chunk_written and (self.streaming or self._handover):
            self.front = dataclasses.replace(self.front, first_chunk_written=self._handover or time.monotonic())
        self._report_first_token(self._current)
        if self._awaiting and self.front.first_chunk_written:
            self._stop_waiting()

    def timings(self, sample: int = 0) -> PhaseTimings:
        return _sample_timings(self.front, self.samples[sample])

    def _stop_waiting(self) -> None:
        """This request no longer waits for its first chunk (counted once, however it stopped)."""
        if self._awaiting:
            self._awaiting = False
            self._deps.first_token_waits.settled()

    def _report_first_token(self, sample: SampleProgress) -> None:
        if sample.first_token_reported or sample.stamps is None or sample.stamps.first_token_ts <= 0.0:
            return
        sample.first_token_reported = True
        deps = self._deps
        deps.observer.request_first_token(
            FirstTokenRecord(
                model=deps.model_name,
                timings=derive_phase_timings(self.front, sample.stamps, sample.completion_tokens, sample.interference),
                prefill_tokens_computed=max(0, self.prompt_tokens - sample.cached_prompt_tokens),
                cached_prompt_tokens=min(sample.cached_prompt_tokens, self.prompt_tokens),
                streaming=self.streaming,
                trace_id=deps.trace_id(),
                sample=sample.index,
                request_first=self._first_tokens_reported == 0,
                constraint=self._parameters.constraint,
                adapter=self.adapter,
            )
        )
        self._first_tokens_reported += 1

    def _end(self, error: BaseException | None) -> None:
        self.front = dataclasses.replace(self.front, ended=time.monotonic())
        # A first token came but its chunk never reached the client (cancelled while it was written): its
        # stages are still observed, once, without a client TTFT.
        for sample in self.samples:
            self._report_first_token(sample)
        code = grpc.StatusCode.OK if error is None else status_for(error)
        if code is grpc.StatusCode.CANCELLED and self._deadline_passed():
            code = grpc.StatusCode.DEADLINE_EXCEEDED
        self._deps.observer.request_finished(self._finished_record(code, error))

    def _finished_record(self, code: grpc.StatusCode, error: BaseException | None) -> PhaseRecord:
        unfinished = "abort" if code in _CLIENT_ENDED else "error"
        deps = self._deps
        first = self._first
        return PhaseRecord(
            model=deps.model_name,
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
            trace_id=deps.trace_id(),
            text=RequestText(self._prompt_text, "".join(self._outputs)) if deps.capture_text else None,
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
            adapter=self.adapter,
        )


def _sample_timings(front: FrontendTimestamps, sample: SampleProgress) -> PhaseTimings:
    timings = derive_phase_timings(front, sample.stamps, sample.completion_tokens, sample.interference)
    if not sample.drafted_tokens:
        return timings
    return dataclasses.replace(
        timings, speculative_drafted_tokens=sample.drafted_tokens, speculative_accepted_tokens=sample.accepted_tokens
    )
