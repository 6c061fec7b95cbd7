"""Every bad request gets INVALID_ARGUMENT naming its field, and the server keeps serving."""

from __future__ import annotations

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2

from phasescope.client.client import Client, build_request
from support.bad_input import BAD_ENGINE_REQUESTS, BAD_REQUESTS, MAX_MODEL_LEN, raw_call
from support.engine_protocol import open_engine_stub
from support.servers import SHARED_CONTEXT, ServerProcess


@pytest.mark.parametrize("case", BAD_REQUESTS)
def test_bad_request_is_invalid_argument_naming_the_field(client: Client, case: str) -> None:
    request, field = BAD_REQUESTS[case]
    for call in (client.generate, lambda r: list(client.generate_stream(r))):
        with pytest.raises(grpc.RpcError) as caught:
            call(request)
        assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
        assert (caught.value.details() or "").startswith(field), caught.value.details()


def test_two_input_kinds_are_refused(server: ServerProcess) -> None:
    data = build_request(prompt="a").SerializeToString() + build_request(token_ids=[1]).SerializeToString()
    code, details = raw_call(server, data)
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("input")


def test_undecodable_bytes_are_refused(server: ServerProcess) -> None:
    code, _ = raw_call(server, b"\x12\xff\xff\xff\xff\x0f")
    assert code is grpc.StatusCode.INVALID_ARGUMENT


def test_server_keeps_serving_and_counts_the_rejections(server: ServerProcess, client: Client) -> None:
    before = server.sample_sum("phasescope_requests_rejected_total", reason="invalid_argument")
    with pytest.raises(grpc.RpcError):
        client.generate(build_request(prompt="hi", top_p=2.0))
    assert server.sample_sum("phasescope_requests_rejected_total", reason="invalid_argument") == before + 1
    assert (
        "Paris"
        in client.generate(
            build_request(chat=[("user", "What is the capital of France?")], temperature=0.0, max_tokens=16)
        ).text
    )
    assert server.health() == "SERVING"


def test_text_too_long_for_the_context_is_refused_unread_with_the_arithmetic(client: Client) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        client.generate(build_request(prompt="x" * 2**20))
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    expected = f"1048576 characters cannot fit in the context window of {SHARED_CONTEXT} tokens"
    assert expected in (caught.value.details() or "")


@pytest.mark.parametrize("case", BAD_ENGINE_REQUESTS)
def test_bad_engine_protocol_request_is_invalid_argument_naming_the_field(server: ServerProcess, case: str) -> None:
    request, field = BAD_ENGINE_REQUESTS[case]
    with open_engine_stub(server.address) as engine:
        for stream in (True, False):
            request.stream = stream
            with pytest.raises(grpc.RpcError) as caught:
                list(engine.Generate(request))
            assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
            assert (caught.value.details() or "").startswith(f"{field}: "), caught.value.details()
        # The worker keeps serving this protocol.
        good = vllm_engine_pb2.GenerateRequest(
            request_id="good", tokenized=vllm_engine_pb2.TokenizedInput(input_ids=[1, 2]),
            sampling_params=vllm_engine_pb2.SamplingParams(max_tokens=2),
        )  # fmt: skip
        assert list(engine.Generate(good))[-1].complete.completion_tokens == 2


def test_what_vllms_worker_serves_on_its_protocol_is_served_here_too(server: ServerProcess) -> None:
    """No request id, and max_tokens beyond the context: vLLM's worker serves both, so the gateway sends both."""
    with open_engine_stub(server.address) as engine:
        without_id = vllm_engine_pb2.GenerateRequest(
            tokenized=vllm_engine_pb2.TokenizedInput(input_ids=[1, 2]),
            sampling_params=vllm_engine_pb2.SamplingParams(max_tokens=2, ignore_eos=True),
        )  # fmt: skip
        assert list(engine.Generate(without_id))[-1].complete.completion_tokens == 2
        to_the_end = vllm_engine_pb2.GenerateRequest(
            request_id="long", tokenized=vllm_engine_pb2.TokenizedInput(input_ids=[42] * (MAX_MODEL_LEN - 3)),
            sampling_params=vllm_engine_pb2.SamplingParams(max_tokens=MAX_MODEL_LEN, ignore_eos=True),
        )  # fmt: skip
        complete = list(engine.Generate(to_the_end))[-1].complete
        assert (complete.completion_tokens, complete.finish_reason) == (3, "length")
