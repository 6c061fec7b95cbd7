"""vllm.grpc.engine.VllmEngine over the shared request lifecycle: what the smg gateway drives.

The Generate handler parses its message (`requests`), walks the shared request path
(`phasescope.serve.path.RequestPath`) like phasescope.v1's, and writes this protocol's messages as
vLLM's own servicer does: a stream sends a chunk per engine step (the step's new token ids) and then
a `GenerateComplete` carrying the last step's ids and the finish reason; a unary call sends one
`GenerateComplete` with every id.
Its phase timings ride in the trailing metadata (`phasescope-timings-bin`, a serialised
`phasescope.v1.Timings`), which routers that do not know it ignore.

`Abort` stops the named requests in the engine; as with vLLM's worker, each stream then ends with
a `GenerateComplete` whose finish reason is "abort". A client that goes away instead cancels its
handler, which closes the engine request at once. `SubscribeKvEvents` relays the engine's KV-cache
events (with --kv-events-config), each batch carrying GetLoads' figures as the engine's load record.
With --kv-transfer-config a request's `kv_transfer_params` reach the engine's KV connector and its
answer comes back on the `GenerateComplete`, as with vLLM's worker (disaggregated prefill and decode).
RPCs this worker does not offer answer UNIMPLEMENTED naming themselves; the gateway tells them from
failures.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import Message
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_servicer import kv_relay
from smg_grpc_servicer.load_record import LOAD_TICK
from smg_grpc_servicer.vllm.kv_transfer import params_to_response_fields

from phasescope.engine.base import TokenLogprob
from phasescope.engine.request import ModelLimits
from phasescope.errors import NotOfferedError
from phasescope.serve.engine_protocol.facts import TokenizerBundle, model_info, server_info, tokenizer_chunks
from phasescope.serve.engine_protocol.loads import engine_load, scheduler_loads
from phasescope.serve.engine_protocol.requests import ADAPTER_METADATA_KEY, decode_generate
from phasescope.serve.path import GenerationAsk, Output, RequestEnd, RequestPath, ServicerContext
from phasescope.serve.timings import TIMINGS_METADATA_KEY, timings_message
from phasescope.serve.validation import UndecodableRequest, decoder
from phasescope.telemetry.step.aggregator import EngineView

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
        self._load_views: tuple[float, list[EngineView]] | None = None
        """When the KV-event stream's load record last read the views, and what it read."""
        self._tokenizer: TokenizerBundle | None = None

    async def Generate(
        self, request: pb.GenerateRequest | UndecodableRequest, context: ServicerContext
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        self._last_receive = time.time()
        streaming = not isinstance(request, UndecodableRequest) and request.stream
        path = self._path

        adapter = next(
            (str(value) for key, value in context.invocation_metadata() or () if key == ADAPTER_METADATA_KEY), ""
        )

        def decode(limits: ModelLimits) -> GenerationAsk:
            return decode_generate(request, limits, path.ready_engine().description.data_parallel_size, adapter)

        async with aclosing(path.generate(streaming, context, decode)) as outputs:
            if streaming:
                async for output in outputs:
                    yield _chunk(output)
                    if output.sample_end is not None:
                        # The sample's complete carries its last step's delta (as vLLM's servicer sends it); the
                        # request's timings go in the trailing metadata before its last complete.
                        if output.request_end is not None:
                            _set_timings(context, output.request_end, output.adapter)
                        yield _complete(output, list(output.step.token_ids), output.step.logprobs)
                return
            # Unary: each sample's ids and log probabilities, then one complete per sample, in order.
            samples: dict[int, _Sample] = {}
            async for output in outputs:
                samples.setdefault(output.step.index, _Sample()).add(output)
                if output.request_end is not None:
                    _set_timings(context, output.request_end, output.adapter)
                    for index in sorted(samples):
                        yield samples[index].complete(output, first=index == 0)

    async def Abort(self, request: pb.AbortRequest, context: ServicerContext) -> pb.AbortResponse:
        # Also while draining: an abort only frees work.
        await self._path.abort(set(request.request_ids))
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
        attached = self._path.ready()
        engine = attached.engine
        views = attached.telemetry.views()[1]
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
        gateway falls back to its own approximate index of what it routed where. Each batch carries the engine's
        load record (`_load_record`), and `load_only` batches carry it while no events flow."""
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
            load_source=self._load_record,
        ):
            yield batch

    def _load_record(self, dp_rank: int | None) -> common_pb2.EngineLoad | None:
        """The load record a KV-event batch of `dp_rank` carries: GetLoads' figures for that rank (None: rank 0),
        with the window's speculative decoding; None before the telemetry is attached. Under load a batch goes out
        every engine step, and reading the window computes its figures and hands the held telemetry on: the views
        are read at most once per relay tick, and the record's `age_ms` says how old they are."""
        attached = self._path.attached
        if attached is None:
            return None
        now = time.monotonic()
        if self._load_views is None or now - self._load_views[0] >= LOAD_TICK:
            self._load_views = (now, attached.telemetry.views()[1])
        read_at, views = self._load_views
        record = engine_load(self._path.ready_engine().description, views, self._path.in_flight, dp_rank)
        if record is not None:
            record.age_ms = round((now - read_at) * 1000)
        return record


class _Sample:
    """What a unary call gathers of one sample: its ids, log probabilities and last step."""

    def __init__(self) -> None:
        self.output_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob] = []
        self.last: Output | None = None

    def add(self, output: Output) -> None:
        self.output_ids.extend(output.step.token_ids)
        self.logprobs.extend(output.step.logprobs)
        self.prompt_logprobs.extend(output.step.prompt_logprobs)
        if output.sample_end is not None:
            self.last = output

    def complete(self, final: Output, *, first: bool) -> pb.GenerateResponse:
        """Its `GenerateComplete` with every id (vLLM's unary answer); the first sample's carries the prompt's
        log probabilities."""
        response = _complete(self.last or final, self.output_ids, self.logprobs)
        if first and self.prompt_logprobs:
            _fill_input_logprobs(response.complete.input_logprobs, final.first_prompt_token, self.prompt_logprobs)
        return response


def _set_timings(context: ServicerContext, end: RequestEnd, adapter: str) -> None:
    timings = timings_message(end.timings, adapter)
    context.set_trailing_metadata(((TIMINGS_METADATA_KEY, timings.SerializeToString()),))


def _chunk(output: Output) -> pb.GenerateResponse:
    step = output.step
    response = pb.GenerateResponse()
    chunk = response.chunk
    chunk.token_ids.extend(step.token_ids)
    chunk.prompt_tokens = output.prompt_tokens
    chunk.completion_tokens = len(step.token_ids)
    chunk.cached_tokens = step.cached_prompt_tokens
    if step.index:
        chunk.index = step.index
    if step.logprobs:
        _fill_logprobs(chunk.output_logprobs, step.logprobs)
    if step.prompt_logprobs:
        _fill_input_logprobs(chunk.input_logprobs, output.first_prompt_token, step.prompt_logprobs)
    return response


def _complete(output: Output, output_ids: list[int], logprobs: Sequence[TokenLogprob]) -> pb.GenerateResponse:
    """A sample's `GenerateComplete`."""
    step = output.step
    response = pb.GenerateResponse()
    complete = response.complete
    complete.output_ids.extend(output_ids)
    complete.finish_reason = step.finish_reason or "stop"
    complete.prompt_tokens = output.prompt_tokens
    complete.completion_tokens = len(output_ids)
    complete.cached_tokens = step.cached_prompt_tokens
    # Under speculative decoding, as vLLM's worker fills them (its --per-request-spec-decode-metrics).
    complete.spec_draft_tokens = step.drafted_tokens
    complete.spec_accepted_tokens = step.accepted_tokens
    if step.index:
        complete.index = step.index
    if isinstance(step.stop_reason, int):
        complete.matched_token_id = step.stop_reason
    elif isinstance(step.stop_reason, str):
        complete.matched_stop_str = step.stop_reason
    if logprobs:
        _fill_logprobs(complete.output_logprobs, logprobs)
    # What the KV connector hands the next worker (a prefill leg's answer), as vLLM's servicer writes it: the JSON
    # field always, the typed one too when the parameters are a host and a port.
    typed, as_json = params_to_response_fields(step.kv_transfer_params)
    if typed is not None:
        complete.kv_transfer_params.CopyFrom(typed)
    if as_json is not None:
        complete.kv_transfer_params_json = as_json
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
