"""vllm.grpc.engine.VllmEngine over the shared request lifecycle: what the smg gateway drives.

The Generate handler parses its message (`requests`), walks `phasescope.serve.lifecycle` like
phasescope.v1's, and writes this protocol's messages as vLLM's own servicer does: a stream sends
a chunk per engine step (the step's new token ids) and then a `GenerateComplete` carrying the
last step's ids and the finish reason; a unary call sends one `GenerateComplete` with every id.
Its phase timings ride in the trailing metadata (`phasescope-timings-bin`, a serialised
`phasescope.v1.Timings`), which routers that do not know it ignore.

`Abort` stops the named requests in the engine; as with vLLM's worker, each stream then ends with
a `GenerateComplete` whose finish reason is "abort". A client that goes away instead cancels its
handler, which closes the engine request at once. `SubscribeKvEvents` relays the engine's KV-cache
events (with --kv-events-config). RPCs this worker does not offer answer UNIMPLEMENTED naming
themselves; the gateway tells them from failures.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc
from google.protobuf.message import Message
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_servicer import kv_relay

from phasescope.engine.base import EngineStep, TokenLogprob
from phasescope.errors import InvalidRequestError, NotOfferedError
from phasescope.serve.engine_protocol.facts import TokenizerBundle, model_info, server_info, tokenizer_chunks
from phasescope.serve.engine_protocol.loads import scheduler_loads
from phasescope.serve.engine_protocol.requests import build_sampling, parse_generate
from phasescope.serve.interceptors import StatusOnError, maps_own_errors
from phasescope.serve.lifecycle import (
    RequestLifecycle,
    RequestPath,
    ServicerContext,
    new_engine_request_id,
    tokenize_off_loop,
)
from phasescope.serve.timings import TIMINGS_METADATA_KEY, timings_message
from phasescope.serve.validation import UndecodableRequest, check_prompt_length, decoder, truncate_prompt
from phasescope.serve.watch import TelemetrySource
from phasescope.telemetry.request.phases import RequestParameters

SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["VllmEngine"].full_name
# Field numbers of GenerateRequest's `input` oneof (tokenized, text).
_GENERATE_INPUT_FIELDS = frozenset({2, 3})


class VllmEngineServicer:
    """Implements vllm.grpc.engine.VllmEngine over the shared request path."""

    def __init__(self, path: RequestPath, *, started: float | None = None) -> None:
        """`started` is the server's start on the wall clock (GetServerInfo's uptime)."""
        self._path = path
        self._started = time.time() if started is None else started
        self._last_receive = 0.0
        self._telemetry: TelemetrySource | None = None
        self._tokenizer: TokenizerBundle | None = None
        # This protocol's requests in the engine, by the gateway's id (several when a caller reuses one).
        self._engine_ids: dict[str, set[str]] = {}

    def attach_telemetry(self, source: TelemetrySource) -> None:
        """Where GetLoads reads the engine's figures (phasescope.serve.app, once they exist)."""
        self._telemetry = source

    def _abortable(self, request_id: str, engine_request_id: str) -> _Abortable:
        """The request can be aborted by the gateway's id while the engine runs it."""
        return _Abortable(self._engine_ids, request_id, engine_request_id)

    @maps_own_errors
    async def Generate(
        self, request: pb.GenerateRequest | UndecodableRequest, context: ServicerContext
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        path = self._path
        self._last_receive = time.time()
        streaming = not isinstance(request, UndecodableRequest) and request.stream
        # The status mapping is here, not in an interceptor's wrapper: each message crosses one generator.
        async with StatusOnError(context), path.begin(streaming, context) as lifecycle:
            engine = path.ready_engine()
            if isinstance(request, UndecodableRequest):
                raise InvalidRequestError(request.field, request.reason)
            asked = parse_generate(request, engine.limits, engine.description.data_parallel_size)
            async with lifecycle.admitted(path.caller(context)):
                prompt = await tokenize_off_loop(engine, asked.parsed)
                sampling_ask = asked.sampling
                keep = sampling_ask.truncate_prompt_tokens if sampling_ask.HasField("truncate_prompt_tokens") else None
                prompt = truncate_prompt(prompt, keep, engine.limits, "sampling_params.truncate_prompt_tokens")
                check_prompt_length(len(prompt), engine.limits, "tokenized.input_ids")
                sampling = build_sampling(asked.sampling, len(prompt), engine.limits)
                # The engine's id is ours (gateway ids may collide across gateways); Abort maps them.
                engine_request_id = new_engine_request_id()
                steps = engine.generate(engine_request_id, prompt, sampling)
                parameters = RequestParameters(
                    max_tokens=sampling.max_tokens,
                    temperature=sampling.temperature,
                    top_p=sampling.top_p,
                    constraint=sampling.structured.kind if sampling.structured is not None else "",
                    samples=sampling.n,
                )
                text = asked.parsed.prompt if path.capture_text else ""
                lifecycle.handed_to_engine(len(prompt), asked.request_id, parameters, text, engine_request_id)
                with self._abortable(asked.request_id, engine_request_id):
                    # One generator between the engine and gRPC (a second layer costs every message).
                    # A unary call's samples: each one's ids and log probabilities, and its last step.
                    outputs: dict[int, tuple[list[int], list[TokenLogprob]]] = {}
                    ends: dict[int, EngineStep] = {}
                    prompt_logprobs: list[TokenLogprob] = []
                    async with aclosing(steps):
                        async for step in steps:
                            lifecycle.took(step)
                            if streaming:
                                yield _chunk(step, lifecycle.prompt_tokens, prompt[0])
                                lifecycle.chunk_written()
                                if step.finish_reason is not None or step.finished:
                                    # A sample's complete carries its last step's delta, as vLLM's servicer sends it.
                                    yield self._last(step, list(step.token_ids), step.logprobs, lifecycle, context)
                                    lifecycle.chunk_written()
                                continue
                            output_ids, logprobs = outputs.setdefault(step.index, ([], []))
                            output_ids.extend(step.token_ids)
                            logprobs.extend(step.logprobs)
                            prompt_logprobs.extend(step.prompt_logprobs)
                            if step.finish_reason is not None or step.finished:
                                ends[step.index] = step
                            if step.finished:
                                # One complete per sample, in order, with every id (vLLM's unary answer).
                                for index in sorted(ends):
                                    output_ids, logprobs = outputs.get(index, ([], []))
                                    last = self._last(ends[index], output_ids, logprobs, lifecycle, context)
                                    if prompt_logprobs and index == 0:
                                        _fill_input_logprobs(last.complete.input_logprobs, prompt[0], prompt_logprobs)
                                    yield last
                                    lifecycle.chunk_written()

    @staticmethod
    def _last(
        step: EngineStep,
        output_ids: list[int],
        logprobs: Sequence[TokenLogprob],
        lifecycle: RequestLifecycle,
        context: ServicerContext,
    ) -> pb.GenerateResponse:
        """A sample's `GenerateComplete`; on the request's last, its timings (the first sample's) are set
        in the trailing metadata first."""
        if step.finished:
            timings = timings_message(lifecycle.final_timings())
            context.set_trailing_metadata(((TIMINGS_METADATA_KEY, timings.SerializeToString()),))
        response = pb.GenerateResponse()
        _fill_complete(response.complete, step, output_ids, lifecycle)
        if logprobs:
            _fill_logprobs(response.complete.output_logprobs, logprobs)
        return response

    async def Abort(self, request: pb.AbortRequest, context: ServicerContext) -> pb.AbortResponse:
        # Also while draining: an abort only frees work.
        engine = self._path.engine
        if engine is None:
            return pb.AbortResponse()
        for request_id in request.request_ids:
            for engine_request_id in list(self._engine_ids.get(request_id, ())):
                await engine.abort(engine_request_id)
        return pb.AbortResponse()

    async def HealthCheck(self, request: pb.HealthCheckRequest, context: ServicerContext) -> pb.HealthCheckResponse:
        try:
            self._path.ready_engine()
        except Exception as exc:  # the reason the engine cannot serve is the answer, not an error
            return pb.HealthCheckResponse(healthy=False, message=str(exc))
        return pb.HealthCheckResponse(healthy=True, message="serving")

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: ServicerContext) -> pb.GetModelInfoResponse:
        return model_info(self._path.ready_engine().description)

    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: ServicerContext
    ) -> pb.GetServerInfoResponse:
        return server_info(
            self._path.ready_engine().description,
            active_requests=self._path.admission.in_flight,
            uptime_seconds=time.time() - self._started,
            last_receive_timestamp=self._last_receive,
            paused=self._path.draining,
        )

    async def GetLoads(self, request: pb.GetLoadsRequest, context: ServicerContext) -> pb.GetLoadsResponse:
        engine = self._path.ready_engine()
        telemetry = self._telemetry
        views = telemetry.views()[1] if telemetry is not None else []
        loads = scheduler_loads(engine.description, views, self._path.in_flight)
        if request.HasField("dp_rank"):
            loads = [load for load in loads if load.dp_rank == request.dp_rank]
        return pb.GetLoadsResponse(
            timestamp=datetime.now(UTC).isoformat(),
            version=engine.description.engine_version,
            dp_rank_count=len(loads),
            loads=loads,
        )

    async def GetTokenizer(
        self, request: common_pb2.GetTokenizerRequest, context: ServicerContext
    ) -> AsyncGenerator[common_pb2.GetTokenizerChunk, None]:
        engine = self._path.ready_engine()
        if self._tokenizer is None:
            self._tokenizer = TokenizerBundle(Path(engine.description.model_path))
        try:
            data, sha256 = await self._tokenizer.archive()
        except FileNotFoundError as exc:
            # A model given by hub id, or a folder without tokenizer files: the gateway then needs
            # --tokenizer-path (or --model-path) of its own.
            raise NotOfferedError(f"GetTokenizer: {exc}") from exc
        for chunk in tokenizer_chunks(data, sha256):
            yield chunk

    async def FlushCache(
        self, request: common_pb2.FlushCacheRequest, context: ServicerContext
    ) -> common_pb2.FlushCacheResponse:
        engine = self._path.ready_engine()
        flushed = await engine.reset_prefix_cache()
        message = "prefix cache reset" if flushed else "the engine refused to reset its prefix cache"
        return common_pb2.FlushCacheResponse(success=flushed, message=message)

    async def Embed(self, request: pb.EmbedRequest, context: ServicerContext) -> pb.EmbedResponse:
        raise NotOfferedError("Embed: this worker serves a generation model (GetModelInfo.is_generation)")

    async def StartProfile(
        self, request: common_pb2.StartProfileRequest, context: ServicerContext
    ) -> common_pb2.ProfileResponse:
        raise NotOfferedError("StartProfile: profiling is not offered by this worker")

    async def StopProfile(
        self, request: common_pb2.StopProfileRequest, context: ServicerContext
    ) -> common_pb2.ProfileResponse:
        raise NotOfferedError("StopProfile: profiling is not offered by this worker")

    async def SubscribeKvEvents(
        self, request: common_pb2.SubscribeKvEventsRequest, context: ServicerContext
    ) -> AsyncGenerator[common_pb2.KvEventBatch, None]:
        """The engine's KV-cache events, every data-parallel rank's publisher in one stream, relayed as vLLM's
        worker relays them (smg-grpc-servicer's relay: sequence gaps replayed, a lost stream ended with
        DATA_LOSS so the gateway clears this worker and subscribes again). Without --kv-events-config the
        gateway falls back to its own approximate index of what it routed where."""
        publishers = self._path.ready_engine().description.kv_event_publishers
        if not publishers:
            raise NotOfferedError(
                "SubscribeKvEvents: KV-cache events are off; start the worker with --kv-events-config "
                '\'{"enable_kv_cache_events": true, "publisher": "zmq"}\''
            )
        sources = [
            kv_relay.RankSource(
                rank=publisher.rank,
                endpoint=kv_relay.endpoint_for_rank(publisher.endpoint, 0),
                replay_endpoint=kv_relay.endpoint_for_rank(publisher.replay_endpoint, 0)
                if publisher.replay_endpoint
                else None,
            )
            for publisher in publishers
        ]
        first = publishers[0]
        async for batch in kv_relay.relay(
            sources,
            kv_relay.Engine.VLLM,
            request.start_sequence_number,
            context,
            topic=first.topic,
            hwm=first.high_water_mark,
        ):
            yield batch


class _Abortable:
    """Lists an engine request under the gateway's id while it runs (`Abort` finds it there). A class, not a
    generator-based context manager: entered by every request."""

    __slots__ = ("_by_request", "_engine_request_id", "_request_id")

    def __init__(self, by_request: dict[str, set[str]], request_id: str, engine_request_id: str) -> None:
        self._by_request = by_request
        self._request_id = request_id
        self._engine_request_id = engine_request_id

    def __enter__(self) -> None:
        self._by_request.setdefault(self._request_id, set()).add(self._engine_request_id)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        engine_ids = self._by_request[self._request_id]
        engine_ids.discard(self._engine_request_id)
        if not engine_ids:
            del self._by_request[self._request_id]


def _chunk(step: EngineStep, prompt_tokens: int, first_prompt_token: int) -> pb.GenerateResponse:
    """A step's chunk, filled in place: `GenerateResponse(chunk=GenerateStreamChunk(...))` copies the
    submessage, and costs twice as much on the path every streamed token takes."""
    response = pb.GenerateResponse()
    chunk = response.chunk
    chunk.token_ids.extend(step.token_ids)
    chunk.prompt_tokens = prompt_tokens
    chunk.completion_tokens = len(step.token_ids)
    chunk.cached_tokens = step.cached_prompt_tokens
    if step.index:
        chunk.index = step.index
    if step.logprobs:
        _fill_logprobs(chunk.output_logprobs, step.logprobs)
    if step.prompt_logprobs:
        _fill_input_logprobs(chunk.input_logprobs, first_prompt_token, step.prompt_logprobs)
    return response


def _fill_input_logprobs(message: pb.InputLogProbs, first: int, logprobs: Sequence[TokenLogprob]) -> None:
    """The protocol's `InputLogProbs`, as vLLM's servicer writes them: the first prompt token with no value
    (nothing precedes it), then each later one's log probability and top-k."""
    message.token_ids.append(first)
    message.token_logprobs.add()
    message.top_logprobs.add()
    for entry in logprobs:
        message.token_ids.append(entry.token_id)
        message.token_logprobs.add(value=entry.logprob)
        _fill_top(message.top_logprobs.add(), entry)


def _fill_logprobs(message: pb.OutputLogProbs, logprobs: Sequence[TokenLogprob]) -> None:
    """The protocol's `OutputLogProbs`: per position, the token, its log probability and the top-k."""
    for entry in logprobs:
        message.token_ids.append(entry.token_id)
        message.token_logprobs.append(entry.logprob)
        _fill_top(message.top_logprobs.add(), entry)


def _fill_top(top: pb.TopLogProbs, entry: TokenLogprob) -> None:
    """One position's most likely tokens, most likely first."""
    for token, value in entry.top:
        top.token_ids.append(token)
        top.values.append(value)


def _fill_complete(
    complete: pb.GenerateComplete, step: EngineStep, output_ids: list[int], lifecycle: RequestLifecycle
) -> None:
    """A sample's `GenerateComplete`, filled in place (as `_chunk` is, for the same reason)."""
    complete.output_ids.extend(output_ids)
    complete.finish_reason = step.finish_reason or "stop"
    complete.prompt_tokens = lifecycle.prompt_tokens
    complete.completion_tokens = len(output_ids)
    complete.cached_tokens = step.cached_prompt_tokens
    if step.index:
        complete.index = step.index
    if isinstance(step.stop_reason, int):
        complete.matched_token_id = step.stop_reason
    elif isinstance(step.stop_reason, str):
        complete.matched_stop_str = step.stop_reason


def _unary(behaviour: Any, request: type[Message], response: type[Message]) -> grpc.RpcMethodHandler[Any, Any]:
    return grpc.unary_unary_rpc_method_handler(behaviour, request.FromString, response.SerializeToString)


def _stream(behaviour: Any, request: type[Message], response: type[Message]) -> grpc.RpcMethodHandler[Any, Any]:
    return grpc.unary_stream_rpc_method_handler(behaviour, request.FromString, response.SerializeToString)


def engine_protocol_handler(servicer: VllmEngineServicer) -> grpc.GenericRpcHandler:
    """The service's handlers; a Generate request that cannot be read is INVALID_ARGUMENT, not INTERNAL."""
    common = common_pb2
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate,
            request_deserializer=decoder(pb.GenerateRequest, _GENERATE_INPUT_FIELDS),
            response_serializer=pb.GenerateResponse.SerializeToString,
        ),
        "Abort": _unary(servicer.Abort, pb.AbortRequest, pb.AbortResponse),
        "HealthCheck": _unary(servicer.HealthCheck, pb.HealthCheckRequest, pb.HealthCheckResponse),
        "GetModelInfo": _unary(servicer.GetModelInfo, pb.GetModelInfoRequest, pb.GetModelInfoResponse),
        "GetServerInfo": _unary(servicer.GetServerInfo, pb.GetServerInfoRequest, pb.GetServerInfoResponse),
        "GetLoads": _unary(servicer.GetLoads, pb.GetLoadsRequest, pb.GetLoadsResponse),
        "GetTokenizer": _stream(servicer.GetTokenizer, common.GetTokenizerRequest, common.GetTokenizerChunk),
        "FlushCache": _unary(servicer.FlushCache, common.FlushCacheRequest, common.FlushCacheResponse),
        "Embed": _unary(servicer.Embed, pb.EmbedRequest, pb.EmbedResponse),
        "StartProfile": _unary(servicer.StartProfile, common.StartProfileRequest, common.ProfileResponse),
        "StopProfile": _unary(servicer.StopProfile, common.StopProfileRequest, common.ProfileResponse),
        "SubscribeKvEvents": _stream(servicer.SubscribeKvEvents, common.SubscribeKvEventsRequest, common.KvEventBatch),
    }
    declared = {method.name for method in pb.DESCRIPTOR.services_by_name["VllmEngine"].methods}
    if declared != set(handlers):
        raise RuntimeError(f"the protocol declares {sorted(declared)} but handlers exist for {sorted(handlers)}")
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)
