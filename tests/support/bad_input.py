"""One catalogue of bad requests for the integration tests, and one way to send raw bytes.

Each typed case names the field its INVALID_ARGUMENT must start with; the raw
cases are wire bytes no typed client can produce, with their precise status.
"""

from __future__ import annotations

import math

import grpc
from smg_grpc_proto.generated import vllm_engine_pb2

from phasescope.client.client import build_request
from phasescope.v1 import inference_pb2 as pb
from support.servers import SHARED_CONTEXT, ServerProcess

MAX_MODEL_LEN = SHARED_CONTEXT  # the shared server's, where these are sent
VOCAB = 49152
INVALID = grpc.StatusCode.INVALID_ARGUMENT


def chat(*turns: tuple[str, str]) -> pb.GenerateRequest:
    return build_request(chat=list(turns), max_tokens=4)


BAD_REQUESTS: dict[str, tuple[pb.GenerateRequest, str]] = {
    "empty input": (pb.GenerateRequest(), "input"),
    "empty prompt": (build_request(prompt=""), "prompt"),
    "empty chat": (pb.GenerateRequest(chat=pb.Chat()), "chat.messages"),
    "unknown chat role": (chat(("user", "hi"), ("wizard", "abracadabra")), "chat.messages[1].role"),
    "empty chat role": (chat(("", "hi")), "chat.messages[0].role"),
    "empty token ids": (pb.GenerateRequest(token_ids=pb.TokenIds()), "token_ids.ids"),
    "token id one past the vocabulary": (build_request(token_ids=[1, VOCAB]), "token_ids.ids[1]"),
    "enormous token id": (build_request(token_ids=[2**32 - 1], max_tokens=2), "token_ids.ids[0]"),
    "max_tokens 0": (build_request(prompt="hi", max_tokens=0), "sampling.max_tokens"),
    "max_tokens beyond the context": (build_request(prompt="hi", max_tokens=MAX_MODEL_LEN), "sampling.max_tokens"),
    "absurd max_tokens": (build_request(prompt="hi", max_tokens=2**32 - 1), "sampling.max_tokens"),
    "max_tokens one past the room left": (
        build_request(token_ids=[42] * 100, max_tokens=MAX_MODEL_LEN - 99), "sampling.max_tokens"
    ),
    "prompt as long as the context": (build_request(token_ids=[42] * MAX_MODEL_LEN), "token_ids"),
    "prompt longer than the context": (build_request(prompt="word " * (MAX_MODEL_LEN + 10)), "prompt"),
    "prompt far past the context": (build_request(prompt="word " * 20_000, max_tokens=1), "prompt"),
    # Refused by length before any tokenising: no tokenisation of a megabyte fits the context.
    "prompt too long for any tokenisation": (build_request(prompt="x" * 2**20), "prompt"),
    "chat too long for any tokenisation": (chat(("system", "x" * 2**19), ("user", "y" * 2**19)), "chat"),
    "negative temperature": (build_request(prompt="hi", temperature=-1.0), "sampling.temperature"),
    "NaN temperature": (build_request(prompt="hi", temperature=math.nan), "sampling.temperature"),
    "infinite temperature": (build_request(prompt="hi", temperature=math.inf), "sampling.temperature"),
    # The engine's own rule (at most 2), found by the fuzz: named like ours, never INTERNAL.
    "temperature above the engine's limit": (build_request(prompt="hi", temperature=3.0), "sampling.temperature"),
    "top_p zero": (build_request(prompt="hi", top_p=0.0), "sampling.top_p"),
    "top_p above one": (build_request(prompt="hi", top_p=1.01), "sampling.top_p"),
    "negative top_p": (build_request(prompt="hi", top_p=-0.5), "sampling.top_p"),
    "NaN top_p": (build_request(prompt="hi", top_p=math.nan), "sampling.top_p"),
    "top_k below -1": (build_request(prompt="hi", top_k=-5), "sampling.top_k"),
    "min_p above one": (build_request(prompt="hi", min_p=1.5), "sampling.min_p"),
    "negative repetition penalty": (build_request(prompt="hi", repetition_penalty=-1.0), "sampling.repetition_penalty"),
    "presence penalty out of range": (build_request(prompt="hi", presence_penalty=3.0), "sampling.presence_penalty"),
    "NaN frequency penalty": (build_request(prompt="hi", frequency_penalty=math.nan), "sampling.frequency_penalty"),
    "stop token outside the vocabulary": (
        build_request(prompt="hi", stop_token_ids=[VOCAB + 1]), "sampling.stop_token_ids[0]"
    ),
    "huge stop list": (build_request(prompt="hi", stop=[f"s{i}" for i in range(10_000)]), "sampling.stop"),
    "stop string of a megabyte": (build_request(prompt="hi", stop=["x" * 2**20]), "sampling.stop"),
    "empty stop string": (build_request(prompt="hi", stop=[""]), "sampling.stop"),
    "huge stop-token list": (build_request(prompt="hi", stop_token_ids=list(range(5000))), "sampling.stop_token_ids"),
    "min_tokens above max_tokens": (build_request(prompt="hi", max_tokens=4, min_tokens=8), "sampling.min_tokens"),
    "log probabilities beyond the engine's maximum": (build_request(prompt="hi", logprobs=21), "sampling.logprobs"),
    "n samples with greedy sampling": (build_request(prompt="hi", n=2, temperature=0.0), "sampling.n"),
    "n of 0": (build_request(prompt="hi", n=0), "sampling.n"),
    "n above the bound": (build_request(prompt="hi", n=129, temperature=1.0), "sampling.n"),
    "prompt log probabilities beyond the engine's maximum": (
        build_request(prompt="hi", prompt_logprobs=21),
        "sampling.prompt_logprobs",
    ),
    "blank bad word": (build_request(prompt="hi", bad_words=["  "]), "sampling.bad_words[0]"),
    "truncation to no tokens": (
        build_request(prompt="hi", truncate_prompt_tokens=0),
        "sampling.truncate_prompt_tokens",
    ),
    "logit bias outside the vocabulary": (build_request(prompt="hi", logit_bias={VOCAB: 1.0}), "sampling.logit_bias"),
    "logit bias beyond 100": (build_request(prompt="hi", logit_bias={5: 250.0}), "sampling.logit_bias[5]"),
    "structured output with no kind": (
        build_request(prompt="hi", structured=pb.StructuredOutput()),
        "sampling.structured",
    ),
    "JSON schema the compiler refuses": (
        build_request(prompt="hi", structured=pb.StructuredOutput(json_schema='{"type": "no-such-type"}')),
        "sampling.structured.json_schema",
    ),
    "regex the compiler refuses": (
        build_request(prompt="hi", structured=pb.StructuredOutput(regex="[0-9")),
        "sampling.structured.regex",
    ),
    "request id of 10 kB": (build_request(prompt="hi", request_id="r" * 10_000), "request_id"),
}  # fmt: skip


def raw_call(server: ServerProcess, data: bytes, method: str = "Generate") -> tuple[grpc.StatusCode, str]:
    """Send `data` as the request's wire bytes; (status, details) of the answer."""
    with grpc.insecure_channel(server.address, options=[("grpc.max_send_message_length", 64 * 2**20)]) as channel:
        call = channel.unary_unary(
            f"/phasescope.v1.Inference/{method}", request_serializer=lambda b: b, response_deserializer=lambda b: b
        )
        try:
            call(data, timeout=60)
        except grpc.RpcError as exc:
            return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def _engine_request(
    ids: tuple[int, ...] = (1, 2, 3), request_id: str = "bad", **sampling: object
) -> vllm_engine_pb2.GenerateRequest:
    return vllm_engine_pb2.GenerateRequest(
        request_id=request_id,
        tokenized=vllm_engine_pb2.TokenizedInput(input_ids=ids),
        sampling_params=vllm_engine_pb2.SamplingParams(**sampling),  # type: ignore[arg-type]  # the cases' own values
    )


# vLLM's engine protocol: what the gateway could send that this worker cannot serve, and the field named.
BAD_ENGINE_REQUESTS: dict[str, tuple[vllm_engine_pb2.GenerateRequest, str]] = {
    "no input": (vllm_engine_pb2.GenerateRequest(request_id="bad"), "input"),
    "empty token ids": (_engine_request(ids=()), "tokenized.input_ids"),
    "token id one past the vocabulary": (_engine_request(ids=(1, VOCAB)), "tokenized.input_ids[1]"),
    "prompt filling the context": (_engine_request(ids=(42,) * MAX_MODEL_LEN), "tokenized.input_ids"),
    "top_p above 1": (_engine_request(top_p=1.5), "sampling_params.top_p"),
    "NaN temperature": (_engine_request(temperature=math.nan), "sampling_params.temperature"),
    "stop token outside the vocabulary": (_engine_request(stop_token_ids=[VOCAB]), "sampling_params.stop_token_ids[0]"),
    "log probabilities beyond the engine's maximum": (_engine_request(logprobs=21), "sampling_params.logprobs"),
    "n samples with greedy sampling": (_engine_request(n=2, temperature=0.0), "sampling_params.n"),
    "n above the bound": (_engine_request(n=129, temperature=1.0), "sampling_params.n"),
    "prompt log probabilities beyond the engine's maximum": (
        _engine_request(prompt_logprobs=21),
        "sampling_params.prompt_logprobs",
    ),
    "truncation below -1": (_engine_request(truncate_prompt_tokens=-2), "sampling_params.truncate_prompt_tokens"),
    "JSON schema that is not JSON": (_engine_request(json_schema='{"type": '), "sampling_params.json_schema"),
    "JSON schema the compiler refuses": (
        _engine_request(json_schema='{"type": "no-such-type"}'),
        "sampling_params.json_schema",
    ),
    "regex the compiler refuses": (_engine_request(regex="[0-9"), "sampling_params.regex"),
    "grammar the compiler refuses": (_engine_request(grammar='root ::= "a'), "sampling_params.grammar"),
    "no choices": (_engine_request(choice=vllm_engine_pb2.ChoiceConstraint()), "sampling_params.choice.choices"),
    "logit bias outside the vocabulary": (_engine_request(logit_bias={VOCAB: -100.0}), "sampling_params.logit_bias"),
    "logit bias beyond 100": (_engine_request(logit_bias={5: -250.0}), "sampling_params.logit_bias[5]"),
    "min_tokens above max_tokens": (_engine_request(max_tokens=4, min_tokens=8), "sampling_params.min_tokens"),
    "multimodal input": (
        vllm_engine_pb2.GenerateRequest(
            request_id="bad",
            tokenized=vllm_engine_pb2.TokenizedInput(input_ids=[1]),
            mm_inputs=vllm_engine_pb2.MultimodalInputs(),
        ),
        "mm_inputs",
    ),
}
