"""Every bad request gets INVALID_ARGUMENT naming its field, and the server keeps serving."""

from __future__ import annotations

import math

import grpc
import pytest

from phasescope.v1 import inference_pb2 as pb
from server.client import PhasescopeClient, build_request
from support.servers import ServerProcess

MAX_MODEL_LEN = 2048  # conftest.BASE_ARGS
VOCAB = 49152


def chat(*turns: tuple[str, str]) -> pb.GenerateRequest:
    return build_request(chat=list(turns), max_tokens=4)


BAD_REQUESTS = {
    "empty input": (pb.GenerateRequest(), "input"),
    "empty prompt": (build_request(prompt=""), "prompt"),
    "empty chat": (pb.GenerateRequest(chat=pb.Chat()), "chat.messages"),
    "unknown chat role": (chat(("user", "hi"), ("wizard", "abracadabra")), "chat.messages[1].role"),
    "empty token ids": (pb.GenerateRequest(token_ids=pb.TokenIds()), "token_ids.ids"),
    "token id outside the vocabulary": (build_request(token_ids=[1, VOCAB]), "token_ids.ids[1]"),
    "max_tokens 0": (build_request(prompt="hi", max_tokens=0), "sampling.max_tokens"),
    "max_tokens beyond the context": (build_request(prompt="hi", max_tokens=MAX_MODEL_LEN), "sampling.max_tokens"),
    "prompt as long as the context": (build_request(token_ids=[42] * MAX_MODEL_LEN), "token_ids"),
    "prompt longer than the context": (build_request(prompt="word " * (MAX_MODEL_LEN + 10)), "prompt"),
    # Refused by length before any tokenising: no tokenisation of a megabyte fits 2,048 tokens.
    "prompt too long for any tokenisation": (build_request(prompt="x" * 2**20), "prompt"),
    "chat too long for any tokenisation": (chat(("system", "x" * 2**19), ("user", "y" * 2**19)), "chat"),
    "negative temperature": (build_request(prompt="hi", temperature=-1.0), "sampling.temperature"),
    "NaN temperature": (build_request(prompt="hi", temperature=math.nan), "sampling.temperature"),
    # The engine's own rule (at most 2), found by the fuzz: named like ours, never INTERNAL.
    "temperature above the engine's limit": (build_request(prompt="hi", temperature=3.0), "sampling.temperature"),
    "top_p zero": (build_request(prompt="hi", top_p=0.0), "sampling.top_p"),
    "top_p above one": (build_request(prompt="hi", top_p=1.01), "sampling.top_p"),
    "top_k below -1": (build_request(prompt="hi", top_k=-5), "sampling.top_k"),
    "stop token outside the vocabulary": (
        build_request(prompt="hi", stop_token_ids=[VOCAB + 1]), "sampling.stop_token_ids[0]"
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD_REQUESTS)
def test_bad_request_is_invalid_argument_naming_the_field(client: PhasescopeClient, case: str) -> None:
    request, field = BAD_REQUESTS[case]
    for call in (client.generate, lambda r: list(client.generate_stream(r))):
        with pytest.raises(grpc.RpcError) as caught:
            call(request)
        assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
        assert (caught.value.details() or "").startswith(field), caught.value.details()


def raw_generate(server, data: bytes) -> grpc.RpcError:
    with grpc.insecure_channel(server.address) as channel:
        call = channel.unary_unary(
            "/phasescope.v1.Inference/Generate",
            request_serializer=lambda raw: raw,
            response_deserializer=pb.GenerateResponse.FromString,
        )
        with pytest.raises(grpc.RpcError) as caught:
            call(data, timeout=30)
    return caught.value


def test_two_input_kinds_are_refused(server: ServerProcess) -> None:
    data = build_request(prompt="a").SerializeToString() + build_request(token_ids=[1]).SerializeToString()
    error = raw_generate(server, data)
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert (error.details() or "").startswith("input")


def test_undecodable_bytes_are_refused(server: ServerProcess) -> None:
    error = raw_generate(server, b"\x12\xff\xff\xff\xff\x0f")
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT


def test_server_keeps_serving_and_counts_the_rejections(server: ServerProcess, client: PhasescopeClient) -> None:
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


def test_text_too_long_for_the_context_is_refused_unread_with_the_arithmetic(client: PhasescopeClient) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        client.generate(build_request(prompt="x" * 2**20))
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "1048576 characters cannot fit in the context window of 2048 tokens" in (caught.value.details() or "")
