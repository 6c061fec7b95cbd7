"""vLLM's engine protocol over a scripted engine: the real servicer, interceptors and gRPC server, driven
through the protocol's published stubs as the gateway drives a worker."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from phasescope.engine.request import StructuredOutput
from phasescope.serve.engine_protocol.servicer import SERVICE_NAME
from phasescope.serve.timings import TIMINGS_METADATA_KEY
from phasescope.serve.watch import request_snapshot
from phasescope.telemetry.step.records import SchedulerState, StepRecord, StepReport
from phasescope.v1 import inference_pb2 as v1
from support.fake_engine import Script, ScriptedEngine
from support.served import eventually, served


def generate(request_id: str = "req-1", ids: tuple[int, ...] = (5, 6, 7), stream: bool = True, **sampling: Any) -> Any:
    return pb.GenerateRequest(
        request_id=request_id,
        tokenized=pb.TokenizedInput(input_ids=ids),
        sampling_params=pb.SamplingParams(**sampling),
        stream=stream,
    )


async def test_a_stream_sends_each_steps_ids_then_the_complete_with_timings_in_trailing_metadata() -> None:
    engine = ScriptedEngine(lambda prompt: Script(tokens=[11, 12, 13], finish_reason="stop", stop_reason=2))
    async with served(engine) as s:
        call = s.stub.Generate(generate(max_tokens=8))
        responses = [response async for response in call]
        trailing = dict(await call.trailing_metadata())
        await eventually(lambda: s.value("phasescope_requests_in_flight") == 0)
        chunks = [r.chunk for r in responses if r.HasField("chunk")]
        (complete,) = [r.complete for r in responses if r.HasField("complete")]
        assert [list(c.token_ids) for c in chunks] == [[11], [12], [13]]
        assert all(c.prompt_tokens == 3 for c in chunks)
        # As vLLM's servicer streams: the complete carries the last step's ids and the finish reason.
        assert (list(complete.output_ids), complete.finish_reason, complete.prompt_tokens) == ([13], "stop", 3)
        assert complete.matched_token_id == 2
        timings = v1.Timings.FromString(trailing[TIMINGS_METADATA_KEY])
        stages = timings.frontend_seconds + timings.intake_seconds + timings.queue_seconds
        assert stages + timings.prefill_seconds + timings.decode_seconds == pytest.approx(timings.e2e_seconds, abs=1e-6)
        # Counted as every request is, whichever door it came in by.
        assert s.value("phasescope_requests_total", code="OK", finish_reason="stop") == 1
        assert s.value("phasescope_tokens_total", phase="decode") == 3
        assert s.value("phasescope_tokens_total", phase="prefill") == 3


async def test_a_unary_generate_sends_one_complete_with_every_id() -> None:
    engine = ScriptedEngine(lambda prompt: Script(tokens=[11, 12, 13], finish_reason="stop", stop_reason="\n\n"))
    async with served(engine) as s:
        responses = [response async for response in s.stub.Generate(generate(stream=False, max_tokens=8))]
        assert [r.WhichOneof("response") for r in responses] == ["complete"]
        complete = responses[0].complete
        assert (list(complete.output_ids), complete.completion_tokens) == ([11, 12, 13], 3)
        assert complete.matched_stop_str == "\n\n"


async def test_max_tokens_ends_the_stream_with_length() -> None:
    async with served(ScriptedEngine(lambda prompt: Script(tokens=[1, 2, 3, 4]))) as s:
        responses = [response async for response in s.stub.Generate(generate(max_tokens=2))]
        assert responses[-1].complete.finish_reason == "length"
        assert sum(len(r.chunk.token_ids) for r in responses if r.HasField("chunk")) == 2


async def test_abort_by_request_id_frees_the_engine_request_and_its_slot() -> None:
    async with served(
        ScriptedEngine(lambda prompt: Script(tokens=[1, 2, 3], hang_after=1)), max_concurrent_requests=1
    ) as s:
        call = s.stub.Generate(generate("to-abort", max_tokens=8))
        first = await call.read()
        assert list(first.chunk.token_ids) == [1]
        await s.stub.Abort(pb.AbortRequest(request_ids=["someone-else", "to-abort"]))
        # As vLLM's worker ends an aborted stream: a last message finished with "abort", status OK.
        rest = []
        while (response := await call.read()) is not grpc.aio.EOF:
            rest.append(response)
        assert rest[-1].complete.finish_reason == "abort"
        assert await call.code() is grpc.StatusCode.OK
        await eventually(lambda: bool(s.engine.aborted) and s.built.path.admission.in_flight == 0)
        assert s.value("phasescope_requests_total", code="OK", finish_reason="abort") == 1
        # The only slot is free: the next request runs.
        s.engine._script_for = lambda prompt: Script(tokens=[9])
        responses = [response async for response in s.stub.Generate(generate("next", max_tokens=1))]
        assert responses[-1].complete.output_ids == [9]


async def test_n_samples_stream_indexed_chunks_and_a_complete_per_sample_as_vllms_servicer_does() -> None:
    engine = ScriptedEngine(lambda prompt: Script(tokens=[11, 12], finish_reason="stop"))
    async with served(engine) as s:
        call = s.stub.Generate(generate(max_tokens=8, n=2, temperature=0.8))
        streamed = [response async for response in call]
        trailing = dict(await call.trailing_metadata())
        unary = [response async for response in s.stub.Generate(generate(max_tokens=8, n=2, stream=False))]
        await eventually(lambda: s.value("phasescope_requests_in_flight") == 0)
    assert [(r.chunk.index, list(r.chunk.token_ids)) for r in streamed if r.HasField("chunk")] == [
        (0, [11]),
        (1, [111]),
        (0, [12]),
        (1, [112]),
    ]
    # Each sample's complete follows its last chunk, with its index and its last step's ids.
    completes = [(r.complete.index, list(r.complete.output_ids)) for r in streamed if r.HasField("complete")]
    assert completes == [(0, [12]), (1, [112])]
    assert v1.Timings.FromString(trailing[TIMINGS_METADATA_KEY]).decode_seconds > 0
    # Unary: one complete per sample, in order, each with every id.
    assert [(r.complete.index, list(r.complete.output_ids), r.complete.finish_reason) for r in unary] == [
        (0, [11, 12], "stop"),
        (1, [111, 112], "stop"),
    ]
    assert s.value("phasescope_requests_total", code="OK", finish_reason="stop") == 2
    assert s.value("phasescope_tokens_total", phase="decode") == 8


async def test_log_probabilities_ride_each_chunk_and_the_unary_complete() -> None:
    engine = ScriptedEngine(lambda prompt: Script(tokens=[11, 12, 13]))
    async with served(engine) as s:
        streamed = [r async for r in s.stub.Generate(generate("s", max_tokens=8, logprobs=2))]
        chunks = [r.chunk for r in streamed if r.HasField("chunk")]
        for chunk in chunks:
            (token,) = chunk.token_ids
            assert list(chunk.output_logprobs.token_ids) == [token]
            assert list(chunk.output_logprobs.token_logprobs) == [-0.25]
            (top,) = chunk.output_logprobs.top_logprobs
            assert list(top.token_ids) == [token, token + 1]
        (unary,) = [r async for r in s.stub.Generate(generate("u", max_tokens=8, logprobs=0, stream=False))]
        assert list(unary.complete.output_logprobs.token_ids) == [11, 12, 13]
        assert [list(top.token_ids) for top in unary.complete.output_logprobs.top_logprobs] == [[], [], []]
        plain = [r async for r in s.stub.Generate(generate("p", max_tokens=8, stream=False))]
        assert not plain[-1].complete.HasField("output_logprobs")
        assert not plain[-1].complete.HasField("input_logprobs")


async def test_a_request_without_an_id_is_served_as_vllms_worker_serves_it() -> None:
    async with served(ScriptedEngine()) as s:
        request = pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=[5, 6]), stream=False)
        (response,) = [r async for r in s.stub.Generate(request)]
        assert response.complete.output_ids


async def test_max_tokens_beyond_the_room_left_reaches_the_engine_as_vllms_worker_passes_it() -> None:
    # Guards issue 46: gateways send max_tokens at the context's size; vLLM's worker lets the engine stop at the
    # context's end (finish reason "length") where phasescope used to refuse it.
    async with served(ScriptedEngine()) as s:  # a 256-token context
        (response,) = [r async for r in s.stub.Generate(generate("long", max_tokens=10_000, stream=False))]
        assert response.HasField("complete")
        (sampling,) = s.engine.sampling.values()
        assert sampling.max_tokens == 10_000


async def test_a_truncated_prompt_reaches_the_engine_as_its_last_tokens() -> None:
    async with served(ScriptedEngine()) as s:
        request = generate("t", ids=(5, 6, 7, 8), max_tokens=2, truncate_prompt_tokens=2, stream=False)
        (response,) = [r async for r in s.stub.Generate(request)]
        assert response.complete.prompt_tokens == 2


async def test_prompt_log_probabilities_ride_the_first_chunk_or_the_unary_complete() -> None:
    async with served(ScriptedEngine()) as s:
        streamed = [r async for r in s.stub.Generate(generate("s", ids=(5, 6, 7), max_tokens=8, prompt_logprobs=1))]
        first, *rest = [r.chunk for r in streamed if r.HasField("chunk")]
        # As vLLM's servicer writes them: the first prompt token has no value (nothing precedes it).
        assert list(first.input_logprobs.token_ids) == [5, 6, 7]
        assert [v.HasField("value") for v in first.input_logprobs.token_logprobs] == [False, True, True]
        assert [list(top.token_ids) for top in first.input_logprobs.top_logprobs] == [[], [6], [7]]
        assert not any(chunk.HasField("input_logprobs") for chunk in rest)
        (unary,) = [r async for r in s.stub.Generate(generate("u", ids=(5, 6), prompt_logprobs=0, stream=False))]
        assert list(unary.complete.input_logprobs.token_ids) == [5, 6]


async def test_structured_outputs_min_tokens_and_logit_bias_reach_the_engine_as_asked() -> None:
    async with served(ScriptedEngine()) as s:
        asks = {
            "schema": generate("schema", json_schema='{"type": "object"}', min_tokens=2, logit_bias={3: -100.0}),
            "choice": generate("choice", choice=pb.ChoiceConstraint(choices=["yes", "no"])),
            "regex": generate("regex", regex="[0-9]+", include_stop_str_in_output=True),
            "object": generate("object", json_object=True),
            "free": generate("free", json_object=False),
        }
        for request in asks.values():
            [response async for response in s.stub.Generate(request)]
        sampling = list(s.engine.sampling.values())
        schema, choice, regex, json_object, free = sampling
        assert schema.structured == StructuredOutput(
            "json_schema", value='{"type": "object"}', field="sampling_params.json_schema"
        )
        assert (schema.min_tokens, schema.logit_bias) == (2, ((3, -100.0),))
        assert choice.structured == StructuredOutput(
            "choice", choices=("yes", "no"), field="sampling_params.choice.choices"
        )
        assert regex.structured == StructuredOutput("regex", value="[0-9]+", field="sampling_params.regex")
        assert regex.include_stop_str_in_output
        assert json_object.structured == StructuredOutput("json_object", field="sampling_params.json_object")
        assert free.structured is None  # json_object false asks for nothing, as vLLM's servicer reads it


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (pb.GenerateRequest(request_id="r"), "input"),
        (generate(ids=()), "tokenized.input_ids"),
        (generate(ids=(1, 10**6)), "tokenized.input_ids[1]"),
        (generate(n=2, temperature=0.0), "sampling_params.n"),
        (generate(n=129), "sampling_params.n"),
        (generate(logprobs=21), "sampling_params.logprobs"),
        (generate(json_schema='{"type": '), "sampling_params.json_schema"),
        (generate(choice=pb.ChoiceConstraint(choices=[])), "sampling_params.choice.choices"),
        (generate(regex=""), "sampling_params.regex"),
        (generate(logit_bias={10**6: 1.0}), "sampling_params.logit_bias"),
        (generate(logit_bias={3: -200.0}), "sampling_params.logit_bias[3]"),
        (generate(max_tokens=4, min_tokens=5), "sampling_params.min_tokens"),
        (generate(top_p=1.5), "sampling_params.top_p"),
        (generate(max_tokens=0), "sampling_params.max_tokens"),
        (generate(temperature=float("nan")), "sampling_params.temperature"),
        (generate(stop_token_ids=[10**6]), "sampling_params.stop_token_ids[0]"),
        (
            pb.GenerateRequest(
                request_id="r", tokenized=pb.TokenizedInput(input_ids=[1]), mm_inputs=pb.MultimodalInputs()
            ),
            "mm_inputs",
        ),
        (
            pb.GenerateRequest(
                request_id="r", tokenized=pb.TokenizedInput(input_ids=[1]), kv_transfer_params_json="[1]"
            ),
            "kv_transfer_params_json",
        ),
        (
            pb.GenerateRequest(
                request_id="r",
                tokenized=pb.TokenizedInput(input_ids=[1]),
                kv_transfer_params=pb.KvTransferParams(remote_host="", remote_port=5600),
            ),
            "kv_transfer_params",
        ),
        (
            pb.GenerateRequest(request_id="r", tokenized=pb.TokenizedInput(input_ids=[1]), data_parallel_rank=3),
            "data_parallel_rank",
        ),
    ],
    ids=lambda value: value if isinstance(value, str) else "",
)
async def test_what_the_worker_cannot_serve_is_invalid_argument_naming_the_field(request_: Any, field: str) -> None:
    async def scenario() -> None:
        async with served(ScriptedEngine()) as s:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in s.stub.Generate(request_):
                    pass
            assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert (caught.value.details() or "").startswith(f"{field}: ")
            # Refused before the engine, counted once, and the server keeps serving.
            assert s.value("phasescope_requests_rejected_total", reason="invalid_argument") == 1
            assert not s.engine.started
            responses = [response async for response in s.stub.Generate(generate(max_tokens=1))]
            assert responses[-1].HasField("complete")

    await scenario()


async def test_a_request_with_both_inputs_or_unreadable_bytes_is_invalid_argument() -> None:
    async with served(ScriptedEngine()) as s:
        both = generate().SerializeToString() + pb.GenerateRequest(text="also text").SerializeToString()
        # The bytes as they are, past the stub's serializer.
        raw = s.channel.unary_stream(
            f"/{SERVICE_NAME}/Generate",
            request_serializer=lambda data: data,
            response_deserializer=pb.GenerateResponse.FromString,
        )
        for payload, field in ((both, "input"), (b"\xff\xff\xff", "request")):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in raw(payload):
                    pass
            assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert (caught.value.details() or "").startswith(f"{field}: ")


async def test_the_management_rpcs_answer_as_a_gateway_expects() -> None:
    async with served(ScriptedEngine()) as s:
        health = await s.stub.HealthCheck(pb.HealthCheckRequest())
        assert health.healthy
        info = await s.stub.GetModelInfo(pb.GetModelInfoRequest())
        assert (info.is_generation, info.served_model_name, info.max_context_length) == (True, "scripted", 256)
        server = await s.stub.GetServerInfo(pb.GetServerInfoRequest())
        assert (server.max_num_seqs, server.data_parallel_size) == (4, 1)
        flushed = await s.stub.FlushCache(common_pb2.FlushCacheRequest())
        assert flushed.success
        assert s.engine.prefix_cache_resets == 1
        for call, request in (
            (s.stub.Embed, pb.EmbedRequest()),
            (s.stub.StartProfile, common_pb2.StartProfileRequest()),
            (s.stub.StopProfile, common_pb2.StopProfileRequest()),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call(request)
            assert caught.value.code() is grpc.StatusCode.UNIMPLEMENTED
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in s.stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest()):
                pass
        assert caught.value.code() is grpc.StatusCode.UNIMPLEMENTED
        # Without --kv-events-config: the refusal says how to turn the events on (the gateway then keeps its own index).
        assert "--kv-events-config" in (caught.value.details() or "")
        # An unhealthy engine is an answer, not an error.
        s.engine.dead = True
        health = await s.stub.HealthCheck(pb.HealthCheckRequest())
        assert (health.healthy, health.message) == (False, "the engine is dead; the server must be restarted")


async def test_get_loads_reports_the_engines_own_figures_and_the_queued_prompt_work() -> None:
    script = Script(tokens=[1, 2], hang_after=0)
    async with served(ScriptedEngine(lambda prompt: script)) as s:
        s.steps.record(
            StepReport(
                scheduler=SchedulerState(0, running=3, waiting=2, kv_cache_usage=0.25),
                step=StepRecord(0, 0, 0, 3, 3, 0.05, flops=1e9, read_bytes=5e9),
            )
        )
        # A request handed to the engine that has no first token yet: its 4 prompt tokens are queued work.
        call = s.stub.Generate(generate("waiting", ids=(1, 2, 3, 4), max_tokens=2))
        await eventually(lambda: bool(s.engine.started))
        loads = await s.stub.GetLoads(pb.GetLoadsRequest())
        (load,) = loads.loads
        assert (load.num_running_reqs, load.num_waiting_reqs, load.num_total_reqs) == (3, 2, 5)
        assert load.token_usage == pytest.approx(0.25)
        assert (load.max_total_num_tokens, load.num_used_tokens, load.max_running_requests) == (4096, 1024, 4)
        assert load.num_waiting_uncached_tokens == 4
        assert load.gen_throughput > 0
        assert 0 < load.utilization <= 1
        call.cancel()


async def test_the_tokenizer_streams_as_a_zip_with_its_digest_and_a_folder_without_one_is_unimplemented() -> None:
    async with served(ScriptedEngine()) as s:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in s.stub.GetTokenizer(common_pb2.GetTokenizerRequest()):
                pass
        assert caught.value.code() is grpc.StatusCode.UNIMPLEMENTED
        assert "GetTokenizer: " in (caught.value.details() or "")


async def test_the_tokenizer_of_a_model_folder_streams_with_its_digest(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0"}')
    (tmp_path / "model.safetensors").write_bytes(b"weights")

    async def scenario() -> None:
        async with served(ScriptedEngine(model_path=str(tmp_path))) as s:
            chunks = [chunk async for chunk in s.stub.GetTokenizer(common_pb2.GetTokenizerRequest())]
            assert chunks
            assert chunks[-1].sha256
            assert all(not chunk.sha256 for chunk in chunks[:-1])

    await scenario()


async def test_a_request_of_this_protocol_is_listed_in_flight_for_watchers_and_top() -> None:
    async with served(ScriptedEngine(lambda prompt: Script(tokens=[1, 2, 3], hang_after=1))) as s:
        call = s.stub.Generate(generate("gw-7", max_tokens=8))
        await call.read()
        (request,) = s.built.path.in_flight
        snapshot = request_snapshot(request, time.monotonic())
        assert (snapshot.request_id, snapshot.phase, snapshot.prompt_tokens) == ("gw-7", "decode", 3)
        call.cancel()
        await eventually(lambda: not s.built.path.in_flight)
