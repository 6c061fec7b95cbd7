"""phasescope.v1 beside smg's Rust server (`--front-end rust`): the Rust server is the engine's only front end, and
phasescope.v1's requests reach the engine through it.

smg's Rust server serves vLLM's engine protocol on --port and owns the engine cores' request path. phasescope.v1
(text, chats, per-request timings, WatchTelemetry, `phasescope top`) is served on --v1-port by the same request
path as in the Python mode (`build_server`), over an engine that is a client of the Rust server
(`RustWorkerEngine`): it tokenises, checks the sampling values by vLLM's rules and detokenises (`TextSide`), sends
token ids, and reads each request's engine stamps from the record its engine core publishes to the hub
(`RecordClaims`, joined by the id the core ran the request under).

One source per figure: every request's series, whichever port it came by, are the engine side's (the hub's
`EngineSideRequests`), so this path's own request series go to a registry nobody scrapes; its spans, its
responses' timings and the live views are its own. The timings' engine stages are the engine's stamps; the
frontend and intake stages and the client's TTFT are this path's; the decode's interference is read from the hub's
ledger at the first chunk and at the end (each lags its step by at most a gathering, at both ends alike).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
from collections.abc import AsyncGenerator
from typing import Any

import grpc
from grpc_health.v1 import health_pb2
from prometheus_client import CollectorRegistry
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_grpc

from phasescope.engine.base import Adapter, EngineStep, ModelDescription, TokenLogprob
from phasescope.engine.request import ModelLimits, ParsedInput, SamplingSpec
from phasescope.engine.vllm.text_side import Detokenizer, TextSide
from phasescope.errors import EngineUnavailableError, InvalidRequestError, NotConfiguredError
from phasescope.serve.build import GRPC_OPTIONS, Built, build_server
from phasescope.serve.config import Settings
from phasescope.serve.engine_protocol.requests import sampling_message
from phasescope.serve.hub import HubTelemetry
from phasescope.telemetry.request.engine_side import RecordClaims
from phasescope.telemetry.request.phases import EngineTimestamps
from phasescope.telemetry.step.records import EngineRequestRecord

logger = logging.getLogger(__name__)

RECORD_WAIT_SECONDS = 2.0
"""How long a request's end waits for its engine record (the core publishes it within a gathering, 50 ms)."""
START_TIMEOUT_SECONDS = 600.0
NO_ADAPTERS = (
    "behind smg's Rust request path no LoRA adapter can be served: vLLM's engine protocol has no field for one and "
    "the Rust server passes no metadata on (serve adapters with --front-end python)"
)


class EngineRequestFailedError(RuntimeError):
    """The engine ended one request with an error and serves on (INTERNAL: the status table's default)."""


def _logprobs(message: Any) -> tuple[TokenLogprob, ...]:
    """The protocol's per-position log probabilities as the project's values."""
    tops = list(message.top_logprobs)
    return tuple(
        TokenLogprob(
            int(token_id),
            float(logprob),
            tuple(zip(map(int, tops[index].token_ids), map(float, tops[index].values), strict=False))
            if index < len(tops)
            else (),
        )
        for index, (token_id, logprob) in enumerate(zip(message.token_ids, message.token_logprobs, strict=False))
    )


def _prompt_logprobs(message: Any) -> tuple[TokenLogprob, ...]:
    """The prompt's, after its first token (nothing precedes the first, so it has none)."""
    tops = list(message.top_logprobs)
    out = []
    for index, (token_id, entry) in enumerate(zip(message.token_ids, message.token_logprobs, strict=False)):
        if index == 0:
            continue
        top = tops[index] if index < len(tops) else None
        out.append(
            TokenLogprob(
                int(token_id),
                float(entry.value) if entry.HasField("value") else float("nan"),
                tuple(zip(map(int, top.token_ids), map(float, top.values), strict=False)) if top is not None else (),
            )
        )
    return tuple(out)


def _stamps(record: EngineRequestRecord | None) -> EngineTimestamps | None:
    if record is None:
        return None
    return EngineTimestamps(record.queued_ts, record.scheduled_ts, record.first_token_ts, record.last_token_ts)


class RustWorkerEngine:
    """The `Engine` phasescope.v1 is served over beside smg's Rust server: a client of it, on vLLM's engine
    protocol, with the text side done here and each request's engine stamps from its engine record."""

    def __init__(self, address: str, text: TextSide, description: ModelDescription, claims: RecordClaims) -> None:
        self._channel = grpc.aio.insecure_channel(address, options=list(GRPC_OPTIONS))
        self._stub: Any = vllm_grpc.VllmEngineStub(self._channel)  # type: ignore[no-untyped-call]  # no stubs
        self._text = text
        self._description = description
        self._claims = claims
        self._aborting: set[str] = set()
        self._dead = False
        self._late_records = 0
        # With data parallelism each request names its engine core, in turn: its chunks' decode is read from that
        # core's interference ledger from the first token on (the Rust server would choose one unseen).
        self._ranks = itertools.cycle(range(description.data_parallel_size))

    @property
    def description(self) -> ModelDescription:
        return self._description

    @property
    def limits(self) -> ModelLimits:
        return self._text.limits

    @property
    def is_dead(self) -> bool:
        return self._dead

    def tokenize(self, parsed: ParsedInput) -> list[int]:
        return self._text.tokenize(parsed)

    @property
    def adapters(self) -> tuple[Adapter, ...]:
        return ()

    async def load_adapter(self, name: str, path: str) -> Adapter:
        raise NotConfiguredError("name", NO_ADAPTERS)

    async def unload_adapter(self, name: str) -> Adapter:
        raise NotConfiguredError("name", NO_ADAPTERS)

    def generate(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingSpec, adapter: str = ""
    ) -> AsyncGenerator[EngineStep, None]:
        if adapter:
            raise NotConfiguredError("adapter", NO_ADAPTERS)
        # Refused now, naming the field: vLLM's rules, and what the protocol cannot carry.
        params = self._text.check(sampling)
        request = pb.GenerateRequest(
            request_id=request_id,
            tokenized=pb.TokenizedInput(input_ids=prompt_token_ids),
            sampling_params=sampling_message(sampling),
            stream=True,
        )
        if sampling.kv_transfer is not None:
            request.kv_transfer_params_json = json.dumps(sampling.kv_transfer.params)
        engine_index = next(self._ranks)
        if self._description.data_parallel_size > 1:
            request.data_parallel_rank = engine_index
        detokenizers = (
            [self._text.detokenizer(request_id, prompt_token_ids, sampling, params) for _ in range(sampling.n)]
            if sampling.detokenize
            else None
        )
        unnamed = sampling.structured.field if sampling.structured is not None else "request"
        return self._steps(request, sampling.n, detokenizers, unnamed, engine_index)

    async def _steps(
        self,
        request: pb.GenerateRequest,
        n: int,
        detokenizers: list[Detokenizer] | None,
        unnamed: str,
        engine_index: int,
    ) -> AsyncGenerator[EngineStep, None]:
        request_id = request.request_id
        # The ids the engine core runs the samples under (smg's Rust server: the id sent, `{id}-{i}` for n > 1).
        engine_ids = [request_id] if n == 1 else [f"{request_id}-{index}" for index in range(n)]
        records = [self._claims.claim(engine_id) for engine_id in engine_ids]
        call = self._stub.Generate(request)
        unfinished = n
        try:
            async for response in call:
                if response.HasField("chunk"):
                    chunk = response.chunk
                    token_ids = tuple(chunk.token_ids)
                    yield EngineStep(
                        text=detokenizers[chunk.index].text(token_ids) if detokenizers is not None else "",
                        token_ids=token_ids,
                        finished=False,
                        finish_reason=None,
                        completion_tokens=chunk.completion_tokens,
                        cached_prompt_tokens=chunk.cached_tokens,
                        stamps=None,
                        engine_index=engine_index,
                        index=chunk.index,
                        logprobs=_logprobs(chunk.output_logprobs) if chunk.HasField("output_logprobs") else (),
                        prompt_logprobs=_prompt_logprobs(chunk.input_logprobs)
                        if chunk.HasField("input_logprobs")
                        else (),
                    )
                    continue
                complete = response.complete
                if complete.finish_reason == "abort" and request_id not in self._aborting:
                    raise EngineUnavailableError("smg's Rust server aborted the request (its engine stopped)")
                if complete.finish_reason == "error":
                    raise EngineRequestFailedError("the engine finished the request with an error (see its log)")
                record = await self._record(records[complete.index])
                unfinished -= 1
                matched = complete.WhichOneof("matched_stop")
                yield EngineStep(
                    text=detokenizers[complete.index].text((), finished=True) if detokenizers is not None else "",
                    token_ids=(),
                    finished=unfinished == 0,
                    finish_reason=complete.finish_reason,
                    completion_tokens=complete.completion_tokens,
                    cached_prompt_tokens=complete.cached_tokens,
                    stamps=_stamps(record),
                    engine_index=engine_index,
                    stop_reason=getattr(complete, matched) if matched is not None else None,
                    index=complete.index,
                    drafted_tokens=complete.spec_draft_tokens,
                    accepted_tokens=complete.spec_accepted_tokens,
                    kv_transfer_params=json.loads(complete.kv_transfer_params_json)
                    if complete.HasField("kv_transfer_params_json")
                    else None,
                )
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidRequestError(unnamed, exc.details() or "refused by the engine") from exc
            if exc.code() is grpc.StatusCode.UNAVAILABLE:
                self._dead = True
            raise EngineUnavailableError(f"smg's Rust server failed the request: {exc.details()}") from exc
        finally:
            # A client gone, a deadline, a failed sample: cancelling the call aborts the engine's work (smg's Rust
            # server aborts a request whose stream is cancelled).
            if unfinished:
                call.cancel()
            for engine_id in engine_ids:
                self._claims.release(engine_id)
            self._aborting.discard(request_id)

    async def _record(self, record: asyncio.Future[EngineRequestRecord]) -> EngineRequestRecord | None:
        try:
            return await asyncio.wait_for(record, RECORD_WAIT_SECONDS)
        except TimeoutError:
            self._late_records += 1
            if self._late_records == 1:
                logger.warning(
                    "a request's engine record did not come within %.0f s of its end: its timings carry no engine "
                    "stages (is the hub receiving the engine cores' reports?)",
                    RECORD_WAIT_SECONDS,
                )
            return None

    async def abort(self, request_id: str) -> None:
        self._aborting.add(request_id)
        await self._stub.Abort(pb.AbortRequest(request_ids=[request_id]))

    async def reset_prefix_cache(self) -> bool:
        response = await self._stub.FlushCache(common_pb2.FlushCacheRequest())
        return bool(response.success)

    async def warm_up(self) -> None:
        """Nothing: smg's Rust server warmed the engine."""

    async def close(self) -> None:
        await self._channel.close()


async def rust_server_answers(address: str, stop: asyncio.Event) -> bool:
    """Wait until smg's Rust server answers on `address` (False: asked to stop first)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub: Any = vllm_grpc.VllmEngineStub(channel)  # type: ignore[no-untyped-call]  # no stubs
        deadline = asyncio.get_running_loop().time() + START_TIMEOUT_SECONDS
        while not stop.is_set():
            with contextlib.suppress(grpc.aio.AioRpcError):
                await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=2.0)
                return True
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"smg's Rust server did not answer on {address} in {START_TIMEOUT_SECONDS:.0f} s")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)
    return False


@dataclasses.dataclass
class V1BesideRust:
    """phasescope.v1 on --v1-port beside smg's Rust server on --port, from `serve` (called once the Rust server
    answers and the engine cores have said what they are) until `stop`."""

    settings: Settings
    telemetry: HubTelemetry
    model_path: str
    model_name: str
    built: Built | None = None
    port: int = 0
    stopping: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    async def serve(self) -> None:
        settings, telemetry = self.settings, self.telemetry
        rust_address = f"{loopback(settings.host)}:{settings.port}"
        aggregator, engine_description = telemetry.aggregator, telemetry.description
        # Both set before `ready`.
        assert aggregator is not None
        assert engine_description is not None
        text = await asyncio.to_thread(TextSide.load, settings.engine_options(), self.model_path, self.model_name)
        configured = text.description()
        description = dataclasses.replace(
            configured,
            kv_cache_capacity_tokens=engine_description.kv_cache_capacity_tokens,
            max_num_seqs=engine_description.max_num_seqs or configured.max_num_seqs,
        )
        engine = RustWorkerEngine(rust_address, text, description, telemetry.claims)
        v1_settings = settings.model_copy(update={"port": settings.effective_v1_port})
        # Its own request series nobody scrapes: every request is counted once, from its engine record.
        built = self.built = build_server(v1_settings, self.model_name, registry=CollectorRegistry())
        built.attach_engine(engine, aggregator.peaks, steps_from=aggregator, recent=telemetry.recent)
        self.port = built.grpc.add_insecure_port(f"{settings.host}:{v1_settings.port}")
        await built.grpc.start()
        await built.set_health(health_pb2.HealthCheckResponse.SERVING)
        logger.info("phasescope.v1 on %s:%d, through smg's Rust server on %s", settings.host, self.port, rust_address)

    async def stop(self) -> None:
        """Drain what phasescope.v1 runs (up to --shutdown-grace-seconds), then stop listening."""
        self.stopping.set()
        built = self.built
        if built is None:
            return
        built.path.draining = True
        await built.health.enter_graceful_shutdown()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(built.path.admission.wait_idle(), timeout=self.settings.shutdown_grace_seconds)
        await built.grpc.stop(grace=1.0)
        built.pipeline.hand_on()
        if built.path.attached is not None:
            await built.path.attached.engine.close()
        if built.tracing is not None:
            await asyncio.to_thread(built.tracing.provider.shutdown)


def loopback(host: str) -> str:
    """Where this process reaches a server it bound on `host`."""
    return "127.0.0.1" if host in ("0.0.0.0", "", "localhost") else ("[::1]" if host in ("::", "[::]") else host)
