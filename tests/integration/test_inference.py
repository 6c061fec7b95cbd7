"""Generate, stream, tokenize and describe against the real engine behind a real gRPC server."""

from __future__ import annotations

import threading
import time
from typing import Any

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from phasescope.client.client import AsyncClient, Client, build_request
from phasescope.v1 import inference_pb2 as pb
from support.servers import SHARED_CONTEXT, ServerProcess

CAPITAL = [("user", "What is the capital of France?")]


def test_greedy_chat_answers_paris(client: Client) -> None:
    response = client.generate(build_request(chat=CAPITAL, temperature=0.0, max_tokens=32))
    assert "Paris" in response.text
    assert response.finish_reason == pb.FINISH_REASON_STOP
    assert response.usage.completion_tokens == len(response.token_ids) > 0
    assert response.usage.prompt_tokens == len(client.tokenize(chat=CAPITAL))


def test_stream_comes_in_several_chunks_that_add_up_to_the_unary_answer(client: Client) -> None:
    request = build_request(
        chat=[("user", "Write a short poem about the sea.")], temperature=0.8, seed=1234, max_tokens=24
    )
    chunks = list(client.generate_stream(request))
    unary = client.generate(request)
    assert len(chunks) > 1
    assert "".join(chunk.text for chunk in chunks) == unary.text
    assert [t for chunk in chunks for t in chunk.token_ids] == list(unary.token_ids)
    # Only the last chunk carries the summary.
    assert all(not chunk.HasField("timings") for chunk in chunks[:-1])
    assert chunks[-1].usage.completion_tokens == len(unary.token_ids)


def test_token_ids_only_streams_the_same_ids_without_text(client: Client) -> None:
    with_text = build_request(chat=CAPITAL, temperature=0.0, max_tokens=16, ignore_eos=True)
    ids_only = build_request(chat=CAPITAL, temperature=0.0, max_tokens=16, ignore_eos=True, token_ids_only=True)
    expected = client.generate(with_text)
    chunks = list(client.generate_stream(ids_only))
    assert expected.text
    assert [t for chunk in chunks for t in chunk.token_ids] == list(expected.token_ids)
    assert all(chunk.text == "" for chunk in chunks)
    assert len(chunks) > 1
    assert chunks[-1].usage.completion_tokens == 16
    # A stop token id still ends it; a stop string, which needs text, is refused by name.
    stopped = client.generate(
        build_request(
            chat=CAPITAL, temperature=0.0, max_tokens=16, token_ids_only=True, stop_token_ids=[expected.token_ids[2]]
        )
    )
    assert list(stopped.token_ids) == list(expected.token_ids[:3])
    assert stopped.finish_reason == pb.FINISH_REASON_STOP
    with pytest.raises(grpc.RpcError) as refused:
        client.generate(build_request(chat=CAPITAL, max_tokens=4, token_ids_only=True, stop=["Paris"]))
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "token_ids_only" in (refused.value.details() or "")


def test_a_stream_interval_sends_the_first_token_alone_then_chunks_of_that_many(client: Client) -> None:
    one_by_one = build_request(chat=CAPITAL, temperature=0.0, max_tokens=10, ignore_eos=True)
    chunked = build_request(chat=CAPITAL, temperature=0.0, max_tokens=10, ignore_eos=True, stream_interval=4)
    expected = [t for chunk in client.generate_stream(one_by_one) for t in chunk.token_ids]
    for token_ids_only in (False, True):
        chunked.token_ids_only = token_ids_only
        chunks = list(client.generate_stream(chunked))
        sizes = [len(chunk.token_ids) for chunk in chunks]
        # The first token at once; then chunks of at least 4 (a slow reader may get two merged); the rest last.
        assert sizes[0] == 1, sizes
        assert all(size >= 4 for size in sizes[1:-1]), sizes
        assert len(chunks) <= 4, sizes
        assert [t for chunk in chunks for t in chunk.token_ids] == expected
        assert chunks[-1].usage.completion_tokens == 10
        assert chunks[-1].timings.decode_seconds > 0


def test_timings_come_from_the_engine_and_add_up(client: Client) -> None:
    response = client.generate(build_request(prompt="Count to twenty:", max_tokens=16, ignore_eos=True))
    t = response.timings
    assert response.usage.completion_tokens == 16
    assert t.queue_seconds >= 0
    assert t.prefill_seconds > 0
    assert t.decode_seconds > 0
    assert t.time_to_first_token_seconds >= t.prefill_seconds
    engine_time = t.queue_seconds + t.prefill_seconds + t.decode_seconds
    # E2E also holds the hop from the front end's arrival to the engine's queue
    # (tokenisation and IPC): never negative, and a small part of the request.
    assert t.e2e_seconds >= engine_time
    assert t.e2e_seconds - engine_time < 0.5 * t.e2e_seconds
    assert t.mean_inter_token_seconds == pytest.approx(t.decode_seconds / 15, rel=1e-6)
    assert t.decode_tokens_per_second == pytest.approx(15 / t.decode_seconds, rel=1e-6)


def test_stream_delivers_tokens_before_the_request_ends(client: Client) -> None:
    arrivals: list[float] = []
    for _ in client.generate_stream(build_request(prompt="Tell me a story.", max_tokens=24, ignore_eos=True)):
        arrivals.append(time.monotonic())
    # Real streaming spreads chunks over the decode; a buffered reply would land all at once.
    assert len(arrivals) > 10
    assert arrivals[-1] - arrivals[0] > 0


def test_cancelled_stream_frees_the_engine(server: ServerProcess, client: Client) -> None:
    cancelled_before = server.sample_sum("phasescope_requests_total", code="CANCELLED")
    stream = client.generate_stream(build_request(prompt="Tell me a long story.", max_tokens=1000, ignore_eos=True))
    for received, _ in enumerate(stream, start=1):
        if received == 3:
            stream.cancel()  # type: ignore[attr-defined]  # the call object is also a grpc.Future
            break
    cancelled_at = time.monotonic()
    # Left alone, the 1,000 tokens would take over a minute: idle within 10 s means the cancel
    # reached the engine (a short bound would only measure how busy the machine is).
    state = server.wait_engine_idle(timeout=10.0)
    assert not any(state.values()), f"still busy {time.monotonic() - cancelled_at:.2f} s after cancel: {state}"
    assert server.sample_sum("phasescope_requests_total", code="CANCELLED") == cancelled_before + 1


def test_deadline_mid_decode_frees_the_engine(server: ServerProcess) -> None:
    with server.client(timeout_seconds=1.0) as short, pytest.raises(grpc.RpcError) as caught:
        for _ in short.generate_stream(build_request(prompt="Go on forever.", max_tokens=1500, ignore_eos=True)):
            pass
    assert caught.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    # 1,500 tokens would take well over a minute: idle within 10 s means the deadline freed them.
    assert server.wait_engine_idle(timeout=10.0) == {"running": 0, "waiting": 0, "in_flight": 0}


def test_concurrent_streams_are_all_served(server: ServerProcess) -> None:
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            with server.client() as c:
                results[index] = c.generate(build_request(prompt=f"Say the number {index}.", max_tokens=8)).text
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert len(results) == 6


def test_tokenize_agrees_with_prompt_usage(client: Client) -> None:
    ids = client.tokenize(text="The quick brown fox")
    assert ids
    response = client.generate(build_request(token_ids=ids, max_tokens=2))
    assert response.usage.prompt_tokens == len(ids)


def test_tokenize_counts_a_document_longer_than_the_context(client: Client) -> None:
    # Counting is not generating: Tokenize takes any text the message size allows.
    ids = client.tokenize(text="word " * 100_000)
    assert len(ids) >= 100_000  # at least a token per word, far past the context


def test_model_info_describes_the_default_model(client: Client) -> None:
    info = client.model_info()
    assert info.model_name == "SmolLM2-135M-Instruct"
    assert info.max_context_length == SHARED_CONTEXT
    assert info.engine == "vllm"
    assert info.engine_version
    # Counted from the checkpoint: embeddings are tied, so stored once.
    assert info.parameter_count == 134_515_008
    assert info.weight_bytes == info.parameter_count * {"float32": 4, "bfloat16": 2, "float16": 2}[info.dtype]
    # 2 x 30 layers x 3 KV heads x 64 dims x element bytes.
    assert info.kv_cache_bytes_per_token == 2 * 30 * 3 * 64 * (info.weight_bytes // info.parameter_count)
    # The config derives the same count as the checkpoint holds (dense: every parameter is active), and
    # on one device the per-device figures are the whole model's.
    assert info.active_parameter_count == info.parameter_count
    assert (info.device_weight_bytes, info.device_kv_cache_bytes_per_token) == (
        info.weight_bytes,
        info.kv_cache_bytes_per_token,
    )
    assert info.device_flops_per_token == info.flops_per_token
    assert info.vocab_size == 49152
    assert info.device


def test_chat_tokenize_renders_the_chat_template(client: Client) -> None:
    plain = client.tokenize(text="What is the capital of France?")
    chat = client.tokenize(chat=CAPITAL)
    # The template wraps the message in role markers (and SmolLM2's default system turn).
    assert len(chat) > len(plain)


async def test_async_client_streams_and_describes(server: ServerProcess) -> None:
    async def scenario() -> tuple[str, int, str]:
        async with AsyncClient(server.address, timeout_seconds=120) as client:
            text = ""
            async for chunk in client.generate_stream(build_request(chat=CAPITAL, temperature=0.0, max_tokens=16)):
                text += chunk.text
            info = await client.model_info()
            return text, info.max_context_length, await client.health()

    text, context, health = await scenario()
    assert "Paris" in text
    assert context == SHARED_CONTEXT
    assert health == "SERVING"


def test_reflection_lists_the_services(server: ServerProcess) -> None:
    with grpc.insecure_channel(server.address) as channel:
        stub: Any = reflection_pb2_grpc.ServerReflectionStub(channel)  # the stubs declare no methods
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        responses = list(stub.ServerReflectionInfo(iter([request]), timeout=10))
    names = {service.name for service in responses[0].list_services_response.service}
    assert {"phasescope.v1.Inference", "grpc.health.v1.Health"} <= names
