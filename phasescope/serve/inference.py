"""phasescope.v1's Inference service: its requests decoded (`phasescope.serve.v1_requests`), walked along the
shared request path, its responses written.

Everything protocol-independent (admission, tokenising, the stages, the first-token and phase records,
rejection counts) is the path's: `phasescope.serve.path`. The servicer never touches Prometheus or tracing.
Exceptions leave through `phasescope.serve.interceptors.ExceptionToStatusInterceptor`, which owns the status table.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

import grpc

from phasescope.engine.base import Adapter, TokenLogprob, adapter_name_problem
from phasescope.errors import InvalidRequestError, NotConfiguredError, WatcherLimitError
from phasescope.serve.admission import Admission
from phasescope.serve.path import Output, RequestEnd, RequestPath, ServicerContext
from phasescope.serve.timings import timings_message
from phasescope.serve.v1_requests import (
    decode_generate,
    decode_tokenize,
    deserialize_generate,
    deserialize_tokenize,
    deserialize_watch,
)
from phasescope.serve.validation import UndecodableRequest
from phasescope.serve.watch import build_snapshot, watch_options
from phasescope.v1 import inference_pb2 as pb

logger = logging.getLogger(__name__)

SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["Inference"].full_name

# An engine-side abort never reaches here as a finish reason: the engine adapter turns it
# into EngineUnavailableError (status UNAVAILABLE), so FINISH_REASON_ABORT is never sent.
_FINISH_REASONS = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
}


def _token_logprobs(logprobs: tuple[TokenLogprob, ...]) -> list[pb.TokenLogprob]:
    return [
        pb.TokenLogprob(
            token_id=entry.token_id,
            logprob=entry.logprob,
            top=[pb.TopLogprob(token_id=token, logprob=value) for token, value in entry.top],
        )
        for entry in logprobs
    ]


def _chunk(output: Output) -> pb.GenerateStreamResponse:
    step = output.step
    chunk = pb.GenerateStreamResponse(request_id=output.request_id, text=step.text, token_ids=step.token_ids)
    if step.index:
        chunk.index = step.index
    if step.logprobs:
        chunk.logprobs.extend(_token_logprobs(step.logprobs))
    if step.prompt_logprobs:
        chunk.prompt_logprobs.extend(_token_logprobs(step.prompt_logprobs))
    if output.sample_end is not None:
        # A sample's last chunk: its finish and its stages (with n = 1, the stream's last chunk).
        chunk.finish_reason = _FINISH_REASONS.get(output.sample_end.finish_reason or "", pb.FINISH_REASON_UNSPECIFIED)
        chunk.timings.CopyFrom(timings_message(output.sample_end.timings, output.adapter))
    if output.request_end is not None:
        chunk.usage.CopyFrom(_usage(output.request_end))
    return chunk


def _usage(end: RequestEnd) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=end.prompt_tokens,
        completion_tokens=end.completion_tokens,
        cached_prompt_tokens=end.cached_prompt_tokens,
    )


class InferenceServicer:
    """Implements phasescope.v1.Inference over the shared request path."""

    def __init__(self, path: RequestPath, *, max_watchers: int = 4, allow_adapter_updates: bool = False) -> None:
        self._path = path
        self._max_watchers = max_watchers
        self._watchers = 0
        self._allow_adapter_updates = allow_adapter_updates

    def start_draining(self) -> None:
        self._path.draining = True

    @property
    def watchers(self) -> int:
        """WatchTelemetry streams open now."""
        return self._watchers

    @property
    def admission(self) -> Admission:
        return self._path.admission

    def _outputs(
        self, request: pb.GenerateRequest | UndecodableRequest, context: ServicerContext, *, streaming: bool
    ) -> AsyncGenerator[Output, None]:
        return self._path.generate(streaming, context, functools.partial(decode_generate, request))

    async def GenerateStream(
        self, request: pb.GenerateRequest | UndecodableRequest, context: ServicerContext
    ) -> AsyncGenerator[pb.GenerateStreamResponse, None]:
        async with aclosing(self._outputs(request, context, streaming=True)) as outputs:
            async for output in outputs:
                yield _chunk(output)

    async def Generate(
        self, request: pb.GenerateRequest | UndecodableRequest, context: ServicerContext
    ) -> pb.GenerateResponse:
        response = pb.GenerateResponse()
        # Each sample's texts; the samples after the first are `response.samples`, by index.
        texts: dict[int, list[str]] = {}
        samples: dict[int, pb.Sample] = {}
        async with aclosing(self._outputs(request, context, streaming=False)) as outputs:
            async for output in outputs:
                step = output.step
                texts.setdefault(step.index, []).append(step.text)
                if step.index:
                    sample = samples.setdefault(step.index, pb.Sample(index=step.index))
                    sample.token_ids.extend(step.token_ids)
                    sample.logprobs.extend(_token_logprobs(step.logprobs))
                    if output.sample_end is not None:
                        sample.finish_reason = _FINISH_REASONS.get(
                            output.sample_end.finish_reason or "", pb.FINISH_REASON_UNSPECIFIED
                        )
                        sample.timings.CopyFrom(timings_message(output.sample_end.timings, output.adapter))
                else:
                    response.token_ids.extend(step.token_ids)
                    response.logprobs.extend(_token_logprobs(step.logprobs))
                    response.prompt_logprobs.extend(_token_logprobs(step.prompt_logprobs))
                    if output.sample_end is not None:
                        response.finish_reason = _FINISH_REASONS.get(
                            output.sample_end.finish_reason or "", pb.FINISH_REASON_UNSPECIFIED
                        )
                        response.timings.CopyFrom(timings_message(output.sample_end.timings, output.adapter))
                if output.request_end is not None:
                    response.request_id = output.request_id
                    response.usage.CopyFrom(_usage(output.request_end))
        response.text = "".join(texts.get(0, ()))
        for index in sorted(samples):
            samples[index].text = "".join(texts[index])
            response.samples.append(samples[index])
        return response

    async def Tokenize(
        self, request: pb.TokenizeRequest | UndecodableRequest, context: ServicerContext
    ) -> pb.TokenizeResponse:
        with self._path.refusals():
            engine = self._path.ready_engine()
            token_ids = await self._path.tokenize(engine, decode_tokenize(request))
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
        attached = self._path.ready()
        if self._watchers >= self._max_watchers:
            raise WatcherLimitError(
                f"{self._watchers} telemetry watchers already (--max-watchers {self._max_watchers}); "
                "close one or retry later"
            )
        facts, source = attached.facts, attached.telemetry
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
        attached = self._path.ready()
        d = attached.engine.description
        peaks = attached.facts.peaks
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
            speculative_method=d.speculative.method if d.speculative else "",
            speculative_tokens=d.speculative.num_speculative_tokens if d.speculative else 0,
            speculative_draft_model=d.speculative.draft_model if d.speculative else "",
            kv_connector=d.kv_connector.connector if d.kv_connector else "",
            kv_role=d.kv_connector.role if d.kv_connector else "",
            kv_engine_id=d.kv_connector.engine_id if d.kv_connector else "",
            max_loras=d.max_loras,
            max_lora_rank=d.max_lora_rank,
            adapters=[_adapter_info(adapter) for adapter in attached.engine.adapters],
        )

    async def ListAdapters(self, request: pb.ListAdaptersRequest, context: ServicerContext) -> pb.ListAdaptersResponse:
        engine = self._path.ready().engine
        return pb.ListAdaptersResponse(adapters=[_adapter_info(adapter) for adapter in engine.adapters])

    def _check_updates_allowed(self) -> None:
        if not self._allow_adapter_updates:
            raise NotConfiguredError(
                "name", "adapters are loaded and unloaded only on a server started with --allow-adapter-updates"
            )

    async def LoadAdapter(self, request: pb.LoadAdapterRequest, context: ServicerContext) -> pb.AdapterInfo:
        self._check_updates_allowed()
        engine = self._path.ready().engine
        problem = adapter_name_problem(request.name)
        if problem:
            raise InvalidRequestError("name", problem)
        if not request.path:
            raise InvalidRequestError("path", "must name the adapter's folder on the server")
        adapter = await engine.load_adapter(request.name, request.path)
        logger.info("serving adapter %s from %s (rank %d, %d bytes)", adapter.name, adapter.path,
                    adapter.shape.rank, adapter.shape.bytes)  # fmt: skip
        return _adapter_info(adapter)

    async def UnloadAdapter(self, request: pb.UnloadAdapterRequest, context: ServicerContext) -> pb.AdapterInfo:
        self._check_updates_allowed()
        adapter = await self._path.ready().engine.unload_adapter(request.name)
        logger.info("no longer serving adapter %s", adapter.name)
        return _adapter_info(adapter)


def _adapter_info(adapter: Adapter) -> pb.AdapterInfo:
    shape = adapter.shape
    return pb.AdapterInfo(
        name=adapter.name,
        path=adapter.path,
        rank=shape.rank,
        alpha=shape.alpha,
        target_modules=list(shape.targets),
        bytes=shape.bytes,
        flops_per_token=shape.flops_per_token,
        dtype=shape.dtype,
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
            request_deserializer=deserialize_generate,
            response_serializer=pb.GenerateResponse.SerializeToString,
        ),
        "GenerateStream": grpc.unary_stream_rpc_method_handler(
            servicer.GenerateStream,
            request_deserializer=deserialize_generate,
            response_serializer=pb.GenerateStreamResponse.SerializeToString,
        ),
        "Tokenize": grpc.unary_unary_rpc_method_handler(
            servicer.Tokenize,
            request_deserializer=deserialize_tokenize,
            response_serializer=pb.TokenizeResponse.SerializeToString,
        ),
        "WatchTelemetry": grpc.unary_stream_rpc_method_handler(
            servicer.WatchTelemetry,
            request_deserializer=deserialize_watch,
            response_serializer=pb.TelemetrySnapshot.SerializeToString,
        ),
        "GetModelInfo": grpc.unary_unary_rpc_method_handler(
            servicer.GetModelInfo,
            request_deserializer=pb.GetModelInfoRequest.FromString,
            response_serializer=pb.ModelInfo.SerializeToString,
        ),
        "ListAdapters": grpc.unary_unary_rpc_method_handler(
            servicer.ListAdapters,
            request_deserializer=pb.ListAdaptersRequest.FromString,
            response_serializer=pb.ListAdaptersResponse.SerializeToString,
        ),
        "LoadAdapter": grpc.unary_unary_rpc_method_handler(
            servicer.LoadAdapter,
            request_deserializer=pb.LoadAdapterRequest.FromString,
            response_serializer=pb.AdapterInfo.SerializeToString,
        ),
        "UnloadAdapter": grpc.unary_unary_rpc_method_handler(
            servicer.UnloadAdapter,
            request_deserializer=pb.UnloadAdapterRequest.FromString,
            response_serializer=pb.AdapterInfo.SerializeToString,
        ),
    }
    declared = {method.name for method in pb.DESCRIPTOR.services_by_name["Inference"].methods}
    if declared != set(handlers):
        raise RuntimeError(f"the proto declares {sorted(declared)} but handlers exist for {sorted(handlers)}")
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)
