"""The Inference service: validate, admit, run on the engine, stream, report one phase record.

The servicer never touches Prometheus or tracing: it hands each finished
request's `PhaseRecord` to a `RequestObserver`. Exceptions leave through
`phasescope.serve.interceptors.ExceptionToStatusInterceptor`, which owns the status table.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import replace
from typing import Any

import grpc

from phasescope.engine.base import Engine, EngineStep
from phasescope.engine.request import ParsedInput
from phasescope.errors import (
    ClientLimitError,
    EngineUnavailableError,
    InvalidRequestError,
    NotReadyError,
    OverloadedError,
    PhasescopeError,
    WatcherLimitError,
)
from phasescope.serve.status import rejection_reason, status_for
from phasescope.serve.validation import (
    UndecodableRequest,
    build_sampling,
    check_prompt_length,
    decode_generate_request,
    decode_tokenize_request,
    decode_watch_request,
    parse_generate_input,
    parse_tokenize_input,
)
from phasescope.serve.watch import ServerFacts, TelemetrySource, build_snapshot, watch_options
from phasescope.telemetry.hardware.peaks import HardwarePeaks
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
from phasescope.v1 import inference_pb2 as pb

logger = logging.getLogger(__name__)

SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["Inference"].full_name

# An engine-side abort never reaches here as a finish reason: the engine adapter turns it
# into EngineUnavailableError (status UNAVAILABLE), so FINISH_REASON_ABORT is never sent.
_FINISH_REASONS = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
}

ServicerContext = grpc.aio.ServicerContext[Any, Any]
# The client ended the request: it went away, or its deadline passed.
_CLIENT_ENDED = (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED)


class Admission:
    """Counts requests in flight and refuses those beyond running + queued capacity, and
    (with a per-client limit) those beyond what one caller may have in flight."""

    def __init__(self, max_running: int, max_queued: int, per_client: int = 0) -> None:
        self.capacity = max_running + max_queued
        self.max_running = max_running
        self.max_queued = max_queued
        self.per_client = per_client
        self.in_flight = 0
        # Only callers with requests in flight have an entry: it is removed at zero.
        self._by_client: dict[str, int] = {}
        self._idle = asyncio.Event()
        self._idle.set()

    def acquire(self, client: str) -> None:
        if self.in_flight >= self.capacity:
            raise OverloadedError(
                f"server at capacity: {self.in_flight} requests in flight "
                f"(--max-concurrent-requests {self.max_running} running + "
                f"--max-queued-requests {self.max_queued} waiting); retry later"
            )
        held = self._by_client.get(client, 0)
        if self.per_client and held >= self.per_client:
            raise ClientLimitError(
                f"this client is at its limit of {self.per_client} requests in flight "
                "(--max-requests-per-client); wait for one to finish"
            )
        self._by_client[client] = held + 1
        self.in_flight += 1
        self._idle.clear()

    def release(self, client: str) -> None:
        held = self._by_client.pop(client) - 1
        if held:
            self._by_client[client] = held
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def wait_idle(self) -> None:
        await self._idle.wait()


def _prompt_text(parsed: ParsedInput) -> str:
    if parsed.kind == "prompt":
        return parsed.prompt
    if parsed.kind == "chat":
        return "\n".join(f"{turn.role}: {turn.content}" for turn in parsed.chat)
    return " ".join(map(str, parsed.token_ids))


def _timings_message(timings: PhaseTimings) -> pb.Timings:
    return pb.Timings(
        queue_seconds=timings.queue_seconds or 0.0,
        prefill_seconds=timings.prefill_seconds or 0.0,
        decode_seconds=timings.decode_seconds or 0.0,
        time_to_first_token_seconds=timings.time_to_first_token_seconds or 0.0,
        e2e_seconds=timings.e2e_seconds or 0.0,
        mean_inter_token_seconds=timings.mean_inter_token_seconds or 0.0,
        decode_tokens_per_second=timings.decode_tokens_per_second or 0.0,
        frontend_seconds=timings.frontend_seconds or 0.0,
        client_time_to_first_token_seconds=timings.client_time_to_first_token_seconds or 0.0,
        intake_seconds=timings.intake_seconds or 0.0,
        decode_stalled_by_prefill_seconds=timings.decode_stalled_by_prefill_seconds or 0.0,
        decode_prefill_interference_seconds=timings.decode_prefill_interference_seconds or 0.0,
    )


class _RequestTrace:
    """What the servicer learns about one request while it streams (no text kept).

    Every reading is `time.monotonic()`, the clock the engine stamps with (phasescope.telemetry.request.phases).
    """

    def __init__(self, prompt_tokens: int, streaming: bool) -> None:
        self.front = FrontendTimestamps(entry=time.monotonic(), wall_at_entry=time.time())
        self.request_id = ""
        self.streaming = streaming
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.cached_prompt_tokens = 0
        self.finish_reason: str | None = None
        self.stamps: EngineTimestamps | None = None
        self.first_token_reported = False

    def mark(self, **stamps: float) -> None:
        self.front = replace(self.front, **stamps)

    def add(self, step: EngineStep) -> int:
        """Take in one engine step; returns how many new output tokens it carried."""
        before = self.completion_tokens
        self.completion_tokens = max(before, step.completion_tokens, before + len(step.token_ids))
        self.cached_prompt_tokens = step.cached_prompt_tokens
        if step.finish_reason is not None:
            self.finish_reason = step.finish_reason
        if step.stamps is not None:
            self.stamps = step.stamps
        return self.completion_tokens - before

    def timings(self) -> PhaseTimings:
        return derive_phase_timings(self.front, self.stamps, self.completion_tokens)

    @property
    def has_first_token(self) -> bool:
        return self.stamps is not None and self.stamps.first_token_ts > 0.0


# gRPC's deadline timer and the handler's reading of the remaining time disagree by a
# little: a cancellation this close to the deadline is the deadline.
_DEADLINE_SLACK_SECONDS = 0.05


def _deadline_passed(context: ServicerContext) -> bool:
    remaining = context.time_remaining()
    return remaining is not None and remaining <= _DEADLINE_SLACK_SECONDS


async def tokenize_off_loop(engine: Engine, parsed: ParsedInput) -> list[int]:
    """Token ids for the input; text is tokenised on a worker thread (vLLM's tokenizer is a
    thread-safe pool), so a long prompt does not stall every other stream on the event loop."""
    if parsed.kind == "token_ids":
        return list(parsed.token_ids)
    return await asyncio.to_thread(engine.tokenize, parsed)


class InferenceServicer:
    """Implements phasescope.v1.Inference over an `Engine`."""

    def __init__(
        self,
        observer: RequestObserver,
        admission: Admission,
        model_name: str,
        *,
        trace_id: Callable[[], str | None] = lambda: None,
        capture_text: bool = False,
        identify: Callable[[ServicerContext], str] = lambda context: "",
        max_watchers: int = 4,
    ) -> None:
        """`trace_id` names the current trace for exemplars (tracing hands one in; the servicer
        never imports OpenTelemetry). `capture_text` puts prompt and output text in the record.
        `identify` names the caller for the per-client limit (phasescope.serve.auth.caller_identity)."""
        self._identify = identify
        self._observer = observer
        self._trace_id = trace_id
        self._capture_text = capture_text
        self._admission = admission
        self._model_name = model_name
        self._engine: Engine | None = None
        self._peaks: HardwarePeaks | None = None
        self._draining = False
        # Requests from admission to their end, for WatchTelemetry (keyed by the trace itself).
        self._in_flight: dict[int, _RequestTrace] = {}
        self._telemetry: tuple[ServerFacts, TelemetrySource] | None = None
        self._max_watchers = max_watchers
        self._watchers = 0

    def attach_engine(self, engine: Engine, peaks: HardwarePeaks) -> None:
        """`peaks` are what each engine is judged against (shared between engines on one CPU)."""
        self._peaks = peaks
        self._engine = engine

    def attach_telemetry(self, facts: ServerFacts, source: TelemetrySource) -> None:
        """What WatchTelemetry snapshots are made of (phasescope.serve.app, once the engine's figures exist)."""
        self._telemetry = (facts, source)

    def start_draining(self) -> None:
        self._draining = True

    @property
    def watchers(self) -> int:
        """WatchTelemetry streams open now."""
        return self._watchers

    @property
    def admission(self) -> Admission:
        return self._admission

    def _ready_engine(self) -> Engine:
        if self._draining:
            raise NotReadyError("the server is shutting down and takes no new requests")
        engine = self._engine
        if engine is None:
            raise NotReadyError("the engine is still starting; wait for the health service to say SERVING")
        if engine.is_dead:
            raise EngineUnavailableError("the engine is dead; the server must be restarted")
        return engine

    def _reject(self, exc: BaseException) -> None:
        reason = rejection_reason(exc)
        if reason is not None:
            self._observer.request_rejected(self._model_name, reason)

    async def _run(
        self, request: pb.GenerateRequest | UndecodableRequest, context: ServicerContext, *, streaming: bool
    ) -> AsyncGenerator[pb.GenerateStreamResponse, None]:
        """The one request path behind Generate and GenerateStream."""
        trace = _RequestTrace(0, streaming)
        try:
            engine = self._ready_engine()
            if isinstance(request, UndecodableRequest):
                raise InvalidRequestError(request.field, request.reason)
            # Cheap checks first (they include the bound on text that cannot fit the context),
            # then the permit: under overload a refused request costs no tokenising.
            parsed = parse_generate_input(request, engine.limits)
            caller = self._identify(context) if self._admission.per_client else ""
            self._admission.acquire(caller)
        except PhasescopeError as exc:
            self._reject(exc)
            raise
        trace.request_id = request.request_id
        self._in_flight[id(trace)] = trace
        try:
            prompt_token_ids = await tokenize_off_loop(engine, parsed)
            check_prompt_length(len(prompt_token_ids), engine.limits, parsed.kind)
            sampling = build_sampling(
                request.sampling,
                len(prompt_token_ids),
                engine.limits,
                token_ids_only=request.token_ids_only,
                stream_interval=request.stream_interval,
            )
            # The engine's id is always ours: client ids may collide. Nothing reaches the
            # engine until the steps are iterated; sampling it refuses raises here.
            engine_request_id = uuid.uuid4().hex
            steps = engine.generate(engine_request_id, prompt_token_ids, sampling)
        except BaseException as exc:
            self._admission.release(caller)
            self._in_flight.pop(id(trace), None)
            if isinstance(exc, PhasescopeError):
                self._reject(exc)
            raise

        # The proto promises an id: the client's, or the engine's when it sent none.
        client_request_id = request.request_id or engine_request_id
        trace.request_id = client_request_id
        trace.prompt_tokens = len(prompt_token_ids)
        code = grpc.StatusCode.OK
        error: BaseException | None = None
        outputs: list[str] = []
        observer = self._observer
        model = self._model_name
        observer.request_started(model)
        trace.mark(handed_to_engine=time.monotonic())
        try:
            async with aclosing(steps):
                async for step in steps:
                    new_tokens = trace.add(step)
                    if new_tokens:
                        observer.tokens_generated(model, new_tokens)
                    if self._capture_text:
                        outputs.append(step.text)
                    chunk = pb.GenerateStreamResponse(
                        request_id=client_request_id, text=step.text, token_ids=step.token_ids
                    )
                    if step.finished:
                        chunk.finish_reason = _FINISH_REASONS.get(
                            step.finish_reason or "", pb.FINISH_REASON_UNSPECIFIED
                        )
                        chunk.usage.prompt_tokens = trace.prompt_tokens
                        chunk.usage.completion_tokens = trace.completion_tokens
                        if not trace.front.first_chunk_written:
                            # This chunk is the stream's first too (or the call is unary): what the
                            # client waits for ends as it is handed over.
                            trace.mark(first_chunk_written=time.monotonic())
                        chunk.timings.CopyFrom(_timings_message(trace.timings()))
                    yield chunk
                    if streaming and not trace.front.first_chunk_written:
                        # grpc.aio resumes a response generator once it has written the chunk.
                        trace.mark(first_chunk_written=time.monotonic())
                    if not trace.first_token_reported and trace.has_first_token:
                        self._report_first_token(trace)
        except BaseException as exc:
            code = status_for(exc)
            if code is grpc.StatusCode.CANCELLED and _deadline_passed(context):
                # gRPC cancels the handler either way: the record says which it was.
                code = grpc.StatusCode.DEADLINE_EXCEEDED
            error = exc
            raise
        finally:
            trace.mark(ended=time.monotonic())
            self._admission.release(caller)
            self._in_flight.pop(id(trace), None)
            if not trace.first_token_reported and trace.has_first_token:
                # The first token came but its chunk never reached the client (cancelled
                # while it was written): its stages are still observed, once.
                trace.mark(first_chunk_written=0.0)
                self._report_first_token(trace)
            observer.request_finished(
                PhaseRecord(
                    model=model,
                    code=code.name,
                    finish_reason=trace.finish_reason or ("abort" if code in _CLIENT_ENDED else "error"),
                    prompt_tokens=trace.prompt_tokens,
                    cached_prompt_tokens=trace.cached_prompt_tokens,
                    completion_tokens=trace.completion_tokens,
                    timings=trace.timings(),
                    front=trace.front,
                    stamps=trace.stamps,
                    streaming=streaming,
                    parameters=RequestParameters(
                        operation="chat" if parsed.kind == "chat" else "text_completion",
                        max_tokens=sampling.max_tokens,
                        temperature=sampling.temperature,
                        top_p=sampling.top_p,
                    ),
                    error=error,
                    trace_id=self._trace_id(),
                    text=RequestText(_prompt_text(parsed), "".join(outputs)) if self._capture_text else None,
                )
            )

    def _report_first_token(self, trace: _RequestTrace) -> None:
        trace.first_token_reported = True
        self._observer.request_first_token(
            FirstTokenRecord(
                model=self._model_name,
                timings=trace.timings(),
                prefill_tokens_computed=max(0, trace.prompt_tokens - trace.cached_prompt_tokens),
                streaming=trace.streaming,
                trace_id=self._trace_id(),
            )
        )

    async def GenerateStream(
        self, request: pb.GenerateRequest | UndecodableRequest, context: ServicerContext
    ) -> AsyncGenerator[pb.GenerateStreamResponse, None]:
        async with aclosing(self._run(request, context, streaming=True)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def Generate(
        self, request: pb.GenerateRequest | UndecodableRequest, context: ServicerContext
    ) -> pb.GenerateResponse:
        response = pb.GenerateResponse()
        texts: list[str] = []
        async with aclosing(self._run(request, context, streaming=False)) as chunks:
            async for chunk in chunks:
                texts.append(chunk.text)
                response.token_ids.extend(chunk.token_ids)
                if chunk.HasField("timings"):
                    response.request_id = chunk.request_id
                    response.finish_reason = chunk.finish_reason
                    response.usage.CopyFrom(chunk.usage)
                    response.timings.CopyFrom(chunk.timings)
        response.text = "".join(texts)
        return response

    async def Tokenize(
        self, request: pb.TokenizeRequest | UndecodableRequest, context: ServicerContext
    ) -> pb.TokenizeResponse:
        try:
            engine = self._ready_engine()
            if isinstance(request, UndecodableRequest):
                raise InvalidRequestError(request.field, request.reason)
            token_ids = await tokenize_off_loop(engine, parse_tokenize_input(request))
        except PhasescopeError as exc:
            self._reject(exc)
            raise
        return pb.TokenizeResponse(token_ids=token_ids, count=len(token_ids))

    async def WatchTelemetry(
        self, request: pb.WatchTelemetryRequest | UndecodableRequest, context: ServicerContext
    ) -> AsyncGenerator[pb.TelemetrySnapshot, None]:
        """A snapshot every interval until the client cancels or the server drains.

        The next snapshot is built only once the previous one is written: a watcher that
        stops reading holds one message in flow control and misses the ticks in between
        (nothing queues for it), and its handler waits without work.
        """
        if isinstance(request, UndecodableRequest):
            raise InvalidRequestError(request.field, request.reason)
        options = watch_options(request)
        self._ready_engine()
        telemetry = self._telemetry
        if telemetry is None:
            raise NotReadyError("the engine's telemetry is still starting; retry in a moment")
        if self._watchers >= self._max_watchers:
            raise WatcherLimitError(
                f"{self._watchers} telemetry watchers already (--max-watchers {self._max_watchers}); "
                "close one or retry later"
            )
        facts, source = telemetry
        self._watchers += 1
        try:
            rejected_before = source.rejected
            tick = time.monotonic()
            while not self._draining:
                rejected = source.rejected
                admission = self._admission
                yield build_snapshot(
                    facts,
                    source,
                    list(self._in_flight.values()),
                    (admission.in_flight, admission.capacity),
                    rejected - rejected_before,
                    options,
                )
                rejected_before = rejected
                # The next tick on the watcher's own grid; ticks missed while it was not reading are skipped.
                now = time.monotonic()
                tick += options.interval_seconds
                if tick <= now:
                    tick += options.interval_seconds * (1 + int((now - tick) // options.interval_seconds))
                await asyncio.sleep(tick - now)
        finally:
            self._watchers -= 1

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: ServicerContext) -> pb.ModelInfo:
        engine = self._ready_engine()
        d = engine.description
        peaks = self._peaks
        assert peaks is not None  # attached together with the engine: each engine's peaks
        bandwidth = peaks.memory_bandwidth_bytes_per_second
        flops = peaks.peak_flops(d.dtype)
        whole = d.cost.sharded(1, 1)
        return pb.ModelInfo(
            flops_per_token=whole.flops_per_token(),
            active_parameter_count=d.cost.active_parameter_count,
            device_weight_bytes=d.cost.device_weight_bytes,
            device_kv_cache_bytes_per_token=d.cost.device_kv_cache_bytes_per_token,
            device_flops_per_token=d.cost.flops_per_token(),
            peak_memory_bandwidth_bytes_per_second=bandwidth,
            peak_flops=flops,
            ridge_point_flops_per_byte=flops / bandwidth,
            peak_source=peaks.source,
            hardware=peaks.description or peaks.device,
            model_name=d.model_name,
            model_path=d.model_path,
            max_context_length=d.max_context_length,
            dtype=d.dtype,
            parameter_count=whole.parameter_count,
            weight_bytes=whole.weight_bytes,
            kv_cache_bytes_per_token=whole.kv_cache_bytes_per_token,
            vocab_size=d.vocab_size,
            engine=d.engine,
            engine_version=d.engine_version,
            device=d.device,
            data_parallel_size=d.data_parallel_size,
            tensor_parallel_size=d.tensor_parallel_size,
            pipeline_parallel_size=d.pipeline_parallel_size,
        )


def inference_handler(servicer: InferenceServicer) -> grpc.GenericRpcHandler:
    """The service's handlers, with decoders that turn unreadable requests into INVALID_ARGUMENT.

    The generated `add_InferenceServicer_to_server` would decode with
    `FromString`, whose failures gRPC reports as INTERNAL, and could not see
    a request that sent two members of the `input` oneof.
    """
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
        "Generate": grpc.unary_unary_rpc_method_handler(
            servicer.Generate,
            request_deserializer=decode_generate_request,
            response_serializer=pb.GenerateResponse.SerializeToString,
        ),
        "GenerateStream": grpc.unary_stream_rpc_method_handler(
            servicer.GenerateStream,
            request_deserializer=decode_generate_request,
            response_serializer=pb.GenerateStreamResponse.SerializeToString,
        ),
        "Tokenize": grpc.unary_unary_rpc_method_handler(
            servicer.Tokenize,
            request_deserializer=decode_tokenize_request,
            response_serializer=pb.TokenizeResponse.SerializeToString,
        ),
        "WatchTelemetry": grpc.unary_stream_rpc_method_handler(
            servicer.WatchTelemetry,
            request_deserializer=decode_watch_request,
            response_serializer=pb.TelemetrySnapshot.SerializeToString,
        ),
        "GetModelInfo": grpc.unary_unary_rpc_method_handler(
            servicer.GetModelInfo,
            request_deserializer=pb.GetModelInfoRequest.FromString,
            response_serializer=pb.ModelInfo.SerializeToString,
        ),
    }
    declared = {method.name for method in pb.DESCRIPTOR.services_by_name["Inference"].methods}
    if declared != set(handlers):
        raise RuntimeError(f"the proto declares {sorted(declared)} but handlers exist for {sorted(handlers)}")
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)
