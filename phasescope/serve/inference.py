"""phasescope.v1's Inference service: parse its messages, run the shared request lifecycle, write its messages.

Everything protocol-independent (admission, the stages, the first-token and phase records,
rejection counts) is the hallway's: `phasescope.serve.lifecycle`. The servicer never
touches Prometheus or tracing. Exceptions leave through
`phasescope.serve.interceptors.ExceptionToStatusInterceptor`, which owns the status table (GenerateStream
applies it itself, `StatusOnError`, so its chunks cross no wrapper generator).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

import grpc

from phasescope.engine.base import Engine, EngineStep, TokenLogprob
from phasescope.engine.request import ParsedInput
from phasescope.errors import InvalidRequestError, NotReadyError, WatcherLimitError
from phasescope.serve.admission import Admission
from phasescope.serve.interceptors import StatusOnError, maps_own_errors
from phasescope.serve.lifecycle import (
    RequestLifecycle,
    RequestPath,
    ServicerContext,
    new_engine_request_id,
    tokenize_off_loop,
)
from phasescope.serve.timings import timings_message
from phasescope.serve.validation import (
    UndecodableRequest,
    build_sampling,
    check_prompt_length,
    decode_generate_request,
    decode_tokenize_request,
    decode_watch_request,
    parse_generate_input,
    parse_tokenize_input,
    truncate_prompt,
)
from phasescope.serve.watch import ServerFacts, TelemetrySource, build_snapshot, watch_options
from phasescope.telemetry.hardware.peaks import HardwarePeaks
from phasescope.telemetry.request.phases import RequestParameters
from phasescope.v1 import inference_pb2 as pb

logger = logging.getLogger(__name__)

SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["Inference"].full_name

# An engine-side abort never reaches here as a finish reason: the engine adapter turns it
# into EngineUnavailableError (status UNAVAILABLE), so FINISH_REASON_ABORT is never sent.
_FINISH_REASONS = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
}


def _prompt_text(parsed: ParsedInput) -> str:
    if parsed.kind == "prompt":
        return parsed.prompt
    if parsed.kind == "chat":
        return "\n".join(f"{turn.role}: {turn.content}" for turn in parsed.chat)
    return " ".join(map(str, parsed.token_ids))


def _token_logprobs(logprobs: tuple[TokenLogprob, ...]) -> list[pb.TokenLogprob]:
    return [
        pb.TokenLogprob(
            token_id=entry.token_id,
            logprob=entry.logprob,
            top=[pb.TopLogprob(token_id=token, logprob=value) for token, value in entry.top],
        )
        for entry in logprobs
    ]


def _chunk(step: EngineStep, request_id: str, lifecycle: RequestLifecycle) -> pb.GenerateStreamResponse:
    chunk = pb.GenerateStreamResponse(request_id=request_id, text=step.text, token_ids=step.token_ids)
    if step.index:
        chunk.index = step.index
    if step.logprobs:
        chunk.logprobs.extend(_token_logprobs(step.logprobs))
    if step.prompt_logprobs:
        chunk.prompt_logprobs.extend(_token_logprobs(step.prompt_logprobs))
    if step.finish_reason is not None or step.finished:
        # A sample's last chunk: its finish and its stages (with n = 1, the stream's last chunk).
        chunk.finish_reason = _FINISH_REASONS.get(step.finish_reason or "", pb.FINISH_REASON_UNSPECIFIED)
        chunk.timings.CopyFrom(timings_message(lifecycle.final_timings(step.index)))
    if step.finished:
        chunk.usage.prompt_tokens = lifecycle.prompt_tokens
        chunk.usage.completion_tokens = lifecycle.completion_tokens
        chunk.usage.cached_prompt_tokens = lifecycle.cached_prompt_tokens
    return chunk


class InferenceServicer:
    """Implements phasescope.v1.Inference over the shared request path."""

    def __init__(self, path: RequestPath, *, max_watchers: int = 4) -> None:
        self._path = path
        self._peaks: HardwarePeaks | None = None
        self._telemetry: tuple[ServerFacts, TelemetrySource] | None = None
        self._max_watchers = max_watchers
        self._watchers = 0

    def attach_engine(self, engine: Engine, peaks: HardwarePeaks) -> None:
        """`peaks` are what each engine is judged against (shared between engines on one CPU)."""
        self._peaks = peaks
        self._path.engine = engine

    def attach_telemetry(self, facts: ServerFacts, source: TelemetrySource) -> None:
        """What WatchTelemetry snapshots are made of (phasescope.serve.app, once the engine's figures exist)."""
        self._telemetry = (facts, source)

    def start_draining(self) -> None:
        self._path.draining = True

    @property
    def watchers(self) -> int:
        """WatchTelemetry streams open now."""
        return self._watchers

    @property
    def admission(self) -> Admission:
        return self._path.admission

    async def _run(
        self, request: pb.GenerateRequest | UndecodableRequest, context: ServicerContext, *, streaming: bool
    ) -> AsyncGenerator[pb.GenerateStreamResponse, None]:
        """The one request path behind Generate and GenerateStream."""
        path = self._path
        async with path.begin(streaming, context) as lifecycle:
            engine = path.ready_engine()
            if isinstance(request, UndecodableRequest):
                raise InvalidRequestError(request.field, request.reason)
            # Cheap checks first (they include the bound on text that cannot fit the context),
            # then the permit: under overload a refused request costs no tokenising.
            parsed = parse_generate_input(request, engine.limits)
            async with lifecycle.admitted(path.caller(context)):
                steps, request_id = await self._hand_to_engine(engine, request, parsed, lifecycle)
                async with aclosing(steps):
                    async for step in steps:
                        lifecycle.took(step)
                        yield _chunk(step, request_id, lifecycle)
                        lifecycle.chunk_written()

    async def _hand_to_engine(
        self, engine: Engine, request: pb.GenerateRequest, parsed: ParsedInput, lifecycle: RequestLifecycle
    ) -> tuple[AsyncGenerator[EngineStep, None], str]:
        """Tokenise, check against the model's limits, and start the engine request; its steps and the
        request id the chunks carry."""
        prompt_token_ids = await tokenize_off_loop(engine, parsed)
        keep = request.sampling.truncate_prompt_tokens if request.sampling.HasField("truncate_prompt_tokens") else None
        prompt_token_ids = truncate_prompt(prompt_token_ids, keep, engine.limits, "sampling.truncate_prompt_tokens")
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
        engine_request_id = new_engine_request_id()
        steps = engine.generate(engine_request_id, prompt_token_ids, sampling)
        # The proto promises an id: the client's, or the engine's when it sent none.
        request_id = request.request_id or engine_request_id
        parameters = RequestParameters(
            operation="chat" if parsed.kind == "chat" else "text_completion",
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            constraint=sampling.structured.kind if sampling.structured is not None else "",
            samples=sampling.n,
        )
        prompt_text = _prompt_text(parsed) if self._path.capture_text else ""
        lifecycle.handed_to_engine(len(prompt_token_ids), request_id, parameters, prompt_text, engine_request_id)
        return steps, request_id

    @maps_own_errors
    async def GenerateStream(
        self, request: pb.GenerateRequest | UndecodableRequest, context: ServicerContext
    ) -> AsyncGenerator[pb.GenerateStreamResponse, None]:
        # The status mapping is here, not in an interceptor's wrapper: each chunk crosses one generator fewer.
        async with StatusOnError(context), aclosing(self._run(request, context, streaming=True)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def Generate(
        self, request: pb.GenerateRequest | UndecodableRequest, context: ServicerContext
    ) -> pb.GenerateResponse:
        response = pb.GenerateResponse()
        texts: list[str] = []
        # With n > 1: the samples after the first, by index, and their texts.
        samples: dict[int, tuple[pb.Sample, list[str]]] = {}
        async with aclosing(self._run(request, context, streaming=False)) as chunks:
            async for chunk in chunks:
                if chunk.HasField("usage"):  # the stream's last chunk, whichever sample's
                    response.request_id = chunk.request_id
                    response.usage.CopyFrom(chunk.usage)
                if chunk.index:
                    if chunk.index not in samples:
                        samples[chunk.index] = (pb.Sample(index=chunk.index), [])
                    sample, sample_texts = samples[chunk.index]
                    sample_texts.append(chunk.text)
                    sample.token_ids.extend(chunk.token_ids)
                    sample.logprobs.extend(chunk.logprobs)
                    if chunk.HasField("timings"):
                        sample.finish_reason = chunk.finish_reason
                        sample.timings.CopyFrom(chunk.timings)
                    continue
                texts.append(chunk.text)
                response.token_ids.extend(chunk.token_ids)
                response.logprobs.extend(chunk.logprobs)
                response.prompt_logprobs.extend(chunk.prompt_logprobs)
                if chunk.HasField("timings"):
                    response.finish_reason = chunk.finish_reason
                    response.timings.CopyFrom(chunk.timings)
        response.text = "".join(texts)
        for index in sorted(samples):
            sample, sample_texts = samples[index]
            sample.text = "".join(sample_texts)
            response.samples.append(sample)
        return response

    async def Tokenize(
        self, request: pb.TokenizeRequest | UndecodableRequest, context: ServicerContext
    ) -> pb.TokenizeResponse:
        with self._path.refusals():
            engine = self._path.ready_engine()
            if isinstance(request, UndecodableRequest):
                raise InvalidRequestError(request.field, request.reason)
            token_ids = await tokenize_off_loop(engine, parse_tokenize_input(request))
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
        self._path.ready_engine()
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
            while not self._path.draining:
                rejected = source.rejected
                admission = self._path.admission
                yield build_snapshot(
                    facts,
                    source,
                    list(self._path.in_flight),
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
        engine = self._path.ready_engine()
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
