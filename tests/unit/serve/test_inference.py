"""The request path without vLLM: the real servicer, interceptors, gRPC server and client, over a scripted engine.

Each test runs a grpc.aio server on a free port in-process and drives it with
the project's async client, so status mapping inside a stream, admission
release, rejection counting and the observers' figures are proved in
milliseconds, rare paths included.
"""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry

from phasescope.client.client import AsyncClient, build_request
from phasescope.errors import EngineUnavailableError
from phasescope.serve.build import build_server
from phasescope.v1 import inference_pb2 as pb
from support.fake_engine import Script, ScriptedEngine
from support.served import MODEL, PEAKS, Served, eventually, served, settings


async def test_a_stream_returns_each_step_then_usage_and_timings() -> None:
    async def scenario() -> tuple[list[pb.GenerateStreamResponse], Served]:
        async with served(ScriptedEngine(lambda prompt: Script(tokens=[5, 6, 7], finish_reason="stop"))) as s:
            chunks = [c async for c in s.client.generate_stream(build_request(prompt="a bb ccc", max_tokens=8))]
            await eventually(lambda: s.value("phasescope_requests_in_flight") == 0 and bool(s.engine.finished))
            return chunks, s

    chunks, s = await scenario()
    assert [list(c.token_ids) for c in chunks] == [[5], [6], [7]]
    last = chunks[-1]
    assert last.finish_reason == pb.FINISH_REASON_STOP
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (3, 3)
    t = last.timings
    # Every stage on one clock, tiling the request from handler entry to last token.
    stages = t.frontend_seconds + t.intake_seconds + t.queue_seconds + t.prefill_seconds + t.decode_seconds
    assert stages == pytest.approx(t.e2e_seconds, abs=1e-6)
    # The server made an id for a request that sent none (the proto promises one).
    assert len(last.request_id) == 32
    assert s.value("phasescope_requests_total", code="OK", finish_reason="stop") == 1
    assert s.value("phasescope_tokens_total", phase="decode") == 3
    assert s.value("phasescope_tokens_total", phase="prefill") == 3
    assert s.value("phasescope_client_time_to_first_token_seconds_count") == 1


async def test_generate_aggregates_the_steps_and_echoes_the_clients_id() -> None:
    async def scenario() -> pb.GenerateResponse:
        async with served(ScriptedEngine()) as s:
            return await s.client.generate(build_request(prompt="hi", request_id="mine", max_tokens=8))

    response = await scenario()
    assert response.text == "t11 t12 t13 "
    assert list(response.token_ids) == [11, 12, 13]
    assert response.request_id == "mine"
    assert response.finish_reason == pb.FINISH_REASON_LENGTH
    assert response.timings.e2e_seconds > 0


async def test_usage_says_how_much_of_the_prompt_the_prefix_cache_held() -> None:
    async def scenario() -> pb.GenerateResponse:
        script = Script(tokens=[5, 6], cached_prompt_tokens=2)
        async with served(ScriptedEngine(lambda prompt: script)) as s:
            return await s.client.generate(build_request(prompt="a bb ccc", max_tokens=8))

    usage = (await scenario()).usage
    assert (usage.prompt_tokens, usage.cached_prompt_tokens, usage.completion_tokens) == (3, 2, 2)


async def test_n_samples_stream_indexed_each_with_its_finish_and_timings_and_usage_counts_them_all() -> None:
    script = Script(tokens=[5, 6], finish_reason="stop", cached_prompt_tokens=0, sample_cached_prompt_tokens=2)

    async def scenario() -> tuple[list[pb.GenerateStreamResponse], pb.GenerateResponse, Served]:
        async with served(ScriptedEngine(lambda prompt: script)) as s:
            request = build_request(prompt="a bb ccc", max_tokens=8, n=3, seed=4)
            chunks = [chunk async for chunk in s.client.generate_stream(request)]
            unary = await s.client.generate(request)
            await eventually(lambda: s.value("phasescope_requests_in_flight") == 0)
            return chunks, unary, s

    chunks, unary, s = await scenario()
    assert [(chunk.index, list(chunk.token_ids)) for chunk in chunks] == [
        (0, [5]),
        (1, [105]),
        (2, [205]),
        (0, [6]),
        (1, [106]),
        (2, [206]),
    ]
    # Each sample's last chunk has its finish and its own timings; usage (every sample's) comes last.
    assert [chunk.index for chunk in chunks if chunk.HasField("timings")] == [0, 1, 2]
    assert all(chunk.finish_reason == pb.FINISH_REASON_STOP for chunk in chunks[3:])
    assert [chunk.HasField("usage") for chunk in chunks] == [False] * 5 + [True]
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (3, 6)
    assert chunks[-1].timings.decode_seconds > 0
    # Unary: the first sample in the response's own fields, the others in order.
    assert (unary.text, list(unary.token_ids), unary.finish_reason) == ("t5 t6 ", [5, 6], pb.FINISH_REASON_STOP)
    assert [(sample.index, sample.text, list(sample.token_ids)) for sample in unary.samples] == [
        (1, "t105 t106 ", [105, 106]),
        (2, "t205 t206 ", [205, 206]),
    ]
    assert all(sample.timings.decode_seconds > 0 for sample in unary.samples)
    assert unary.usage.completion_tokens == 6
    # Two requests: each counted once, its shared stages once, and each sample's sequence on its own —
    # prefill computed for the first sample's whole prompt and the rest of each later one's.
    assert s.value("phasescope_requests_total", code="OK", finish_reason="stop") == 2
    assert s.value("phasescope_request_phase_seconds_count", phase="frontend") == 2
    assert s.value("phasescope_client_time_to_first_token_seconds_count") == 1  # the stream's
    for phase in ("queue", "prefill", "decode"):
        assert s.value("phasescope_request_phase_seconds_count", phase=phase) == 6, phase
    assert s.value("phasescope_time_to_first_token_seconds_count") == 6
    assert s.value("phasescope_request_duration_seconds_count") == 6
    assert s.value("phasescope_tokens_total", phase="prefill") == 2 * (3 + 1 + 1)
    assert s.value("phasescope_tokens_total", phase="decode") == 12
    sampled = s.engine.sampling[s.engine.started[0]]
    assert (sampled.n, sampled.seed) == (3, 4)


@pytest.mark.parametrize(
    ("sampling", "reason"),
    [({"n": 2, "temperature": 0.0}, "greedy"), ({"n": 0}, "[1, 128]"), ({"n": 129}, "[1, 128]")],
)
async def test_n_the_engine_cannot_sample_is_refused_naming_it(sampling: dict[str, Any], reason: str) -> None:
    async def scenario() -> grpc.aio.AioRpcError:
        async with served(ScriptedEngine()) as s:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await s.client.generate(build_request(prompt="hi", max_tokens=2, **sampling))
            assert not s.engine.started
            return caught.value

    error = await scenario()
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert (error.details() or "").startswith("sampling.n: ")
    assert reason in (error.details() or "")


async def test_log_probabilities_come_with_every_token_streamed_and_unary() -> None:
    async def scenario() -> tuple[list[pb.GenerateStreamResponse], pb.GenerateResponse]:
        async with served(ScriptedEngine()) as s:
            request = build_request(prompt="hi", max_tokens=8, logprobs=1)
            chunks = [chunk async for chunk in s.client.generate_stream(request)]
            return chunks, await s.client.generate(request)

    chunks, unary = await scenario()
    for chunk in chunks:
        assert [entry.token_id for entry in chunk.logprobs] == list(chunk.token_ids)
    assert [(e.token_id, e.logprob, [(t.token_id, t.logprob) for t in e.top]) for e in unary.logprobs] == [
        (token, -0.25, [(token, -0.25)]) for token in (11, 12, 13)
    ]
    assert not unary.prompt_logprobs


async def test_prompt_log_probabilities_come_once_for_each_prompt_token_after_the_first() -> None:
    async def scenario() -> tuple[list[pb.GenerateStreamResponse], pb.GenerateResponse]:
        async with served(ScriptedEngine()) as s:
            request = build_request(token_ids=[5, 6, 7], max_tokens=8, prompt_logprobs=0)
            chunks = [chunk async for chunk in s.client.generate_stream(request)]
            return chunks, await s.client.generate(request)

    chunks, unary = await scenario()
    assert [entry.token_id for entry in chunks[0].prompt_logprobs] == [6, 7]
    assert not any(chunk.prompt_logprobs for chunk in chunks[1:])
    assert [entry.token_id for entry in unary.prompt_logprobs] == [6, 7]


async def test_an_engine_failure_mid_stream_ends_it_unavailable_and_frees_its_slot() -> None:
    script = Script(tokens=[1, 2, 3, 4], fail_after=2, failure=EngineUnavailableError("an engine core stopped"))

    async def scenario() -> tuple[list[int], grpc.StatusCode, Served, int]:
        async with served(ScriptedEngine(lambda prompt: script), max_concurrent_requests=1) as s:
            received: list[int] = []

            async def read() -> None:
                async for chunk in s.client.generate_stream(build_request(prompt="x", max_tokens=8)):
                    received.extend(chunk.token_ids)

            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await read()
            await eventually(lambda: s.built.path.admission.in_flight == 0)
            # The only slot is free again: the next request is admitted.
            after = await s.client.generate(build_request(prompt="y", max_tokens=1))
            return received, caught.value.code(), s, len(after.token_ids)

    received, code, s, served_after = await scenario()
    assert received == [1, 2]
    assert code is grpc.StatusCode.UNAVAILABLE
    assert served_after == 1
    assert s.value("phasescope_requests_total", code="UNAVAILABLE", finish_reason="error") == 1


async def test_an_unexpected_engine_error_is_internal_and_hides_its_details() -> None:
    script = Script(fail_after=0, failure=ZeroDivisionError("secret internals"))

    async def scenario() -> grpc.aio.AioRpcError:
        async with served(ScriptedEngine(lambda prompt: script)) as s:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await s.client.generate(build_request(prompt="x", max_tokens=8))
            await eventually(lambda: s.value("phasescope_requests_total", code="INTERNAL", finish_reason="error") == 1)
            return caught.value

    error = await scenario()
    assert error.code() is grpc.StatusCode.INTERNAL
    assert "secret internals" not in (error.details() or "")


async def test_a_client_cancel_aborts_the_engine_request_and_counts_it() -> None:
    async def scenario() -> Served:
        async with served(ScriptedEngine(lambda prompt: Script(tokens=[1, 2, 3], hang_after=1))) as s:
            stream = s.client.generate_stream(build_request(prompt="x", max_tokens=8))
            async for _ in stream:
                break
            await stream.aclose()  # type: ignore[attr-defined]  # an async generator
            await eventually(lambda: bool(s.engine.aborted) and s.built.path.admission.in_flight == 0)
            return s

    s = await scenario()
    assert len(s.engine.aborted) == 1
    assert s.value("phasescope_requests_total", code="CANCELLED", finish_reason="abort") == 1
    # Its first token came, so it is no "request without a first token".
    assert s.value("phasescope_requests_without_first_token_total", code="CANCELLED") == 0
    assert s.value("phasescope_time_to_first_token_seconds_count") == 1


async def test_a_deadline_before_the_first_token_is_recorded_as_such() -> None:
    async def scenario() -> Served:
        async with served(ScriptedEngine(lambda prompt: Script(hang_after=0))) as s:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await s.client.generate(build_request(prompt="x", max_tokens=8), deadline_seconds=0.2)
            assert caught.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            await eventually(lambda: s.value("phasescope_requests_in_flight") == 0 and bool(s.engine.aborted))
            return s

    s = await scenario()
    assert s.value("phasescope_requests_without_first_token_total", code="DEADLINE_EXCEEDED") == 1
    assert s.value("phasescope_requests_total", code="DEADLINE_EXCEEDED", finish_reason="abort") == 1
    assert s.value("phasescope_request_phase_seconds_count", phase="abandoned") == 1
    assert s.value("phasescope_time_to_first_token_seconds_count") == 0


async def test_over_capacity_is_refused_before_tokenising_and_counted() -> None:
    tokenised: list[str] = []

    class CountingEngine(ScriptedEngine):
        def tokenize(self, parsed):  # type: ignore[no-untyped-def]  # same signature as the base
            tokenised.append(parsed.kind)
            return super().tokenize(parsed)

    async def scenario() -> tuple[grpc.StatusCode, Served]:
        async with served(CountingEngine(lambda prompt: Script(hang_after=1)), max_concurrent_requests=1) as s:
            holder = s.client.generate_stream(build_request(prompt="hold", max_tokens=8))
            async for _ in holder:
                break
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await s.client.generate(build_request(prompt="refused please", max_tokens=8))
            await holder.aclose()  # type: ignore[attr-defined]  # an async generator
            return caught.value.code(), s

    code, s = await scenario()
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
    # Only the admitted request was tokenised: a refusal costs no tokenising.
    assert tokenised == ["prompt"]
    assert s.value("phasescope_requests_rejected_total", reason="overloaded") == 1


async def test_a_refusal_after_admission_frees_the_slot_and_is_counted() -> None:
    async def scenario() -> tuple[grpc.StatusCode, Served, int]:
        async with served(ScriptedEngine(), max_concurrent_requests=1) as s:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                # The engine refuses this sampling after the permit was taken.
                await s.client.generate(build_request(prompt="x", max_tokens=8, temperature=3.0))
            ok = await s.client.generate(build_request(prompt="y", max_tokens=2))
            return caught.value.code(), s, len(ok.token_ids)

    s_code, s, answered = await scenario()
    assert s_code is grpc.StatusCode.INVALID_ARGUMENT
    assert answered == 2
    assert s.built.path.admission.in_flight == 0
    assert s.value("phasescope_requests_rejected_total", reason="invalid_argument") == 1


async def test_tokenize_refusals_are_counted_as_rejections() -> None:
    async def scenario() -> tuple[grpc.StatusCode, Served]:
        async with served(ScriptedEngine()) as s:
            s.built.path.draining = True
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await s.client.tokenize("hello")
            return caught.value.code(), s

    code, s = await scenario()
    assert code is grpc.StatusCode.UNAVAILABLE
    assert s.value("phasescope_requests_rejected_total", reason="not_ready") == 1


async def test_a_dead_engine_refuses_new_requests_unavailable() -> None:
    engine = ScriptedEngine()
    engine.dead = True

    async def scenario() -> tuple[grpc.StatusCode, Served]:
        async with served(engine) as s:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await s.client.generate(build_request(prompt="x", max_tokens=2))
            return caught.value.code(), s

    code, s = await scenario()
    assert code is grpc.StatusCode.UNAVAILABLE
    assert s.value("phasescope_requests_rejected_total", reason="engine_unavailable") == 1
    assert not engine.started


async def test_model_info_reports_the_peaks_each_engine_is_judged_against() -> None:
    async def scenario() -> pb.ModelInfo:
        async with served(ScriptedEngine()) as s:
            return await s.client.model_info()

    info = await scenario()
    assert info.peak_memory_bandwidth_bytes_per_second == 100e9
    assert info.peak_flops == 1e12
    assert info.ridge_point_flops_per_byte == 10
    assert info.peak_source == "flag"
    assert info.flops_per_token == 2e6


async def test_until_the_engine_is_attached_requests_are_refused_as_not_ready_then_served() -> None:
    registry = CollectorRegistry()
    built = build_server(settings(), MODEL, registry=registry)
    port = built.grpc.add_insecure_port("127.0.0.1:0")
    await built.grpc.start()
    try:
        async with AsyncClient(f"127.0.0.1:{port}", timeout_seconds=10) as client:
            for refused in (client.generate(build_request(prompt="x", max_tokens=2)), client.model_info()):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await refused
                assert caught.value.code() is grpc.StatusCode.UNAVAILABLE
                assert "the engine is still starting" in (caught.value.details() or "")
            engine = ScriptedEngine(lambda prompt: Script(tokens=[1, 2]))
            built.attach_engine(engine, PEAKS)
            assert (await client.generate(build_request(prompt="x", max_tokens=2))).usage.completion_tokens == 2
    finally:
        await built.grpc.stop(grace=None)
