"""vLLM's engine-protocol `GenerateRequest`, parsed into the engine's request model or refused.

What the engine cannot do is refused with INVALID_ARGUMENT naming the field (never silently
ignored). The protocol's sampling fields are plain proto3 scalars, so 0 means "not set" for
them, as vLLM's own servicer reads them (`temperature` and `max_tokens` are `optional` and
read as such); an unset value is the model's default, as on phasescope.v1. As vLLM's servicer
does, the engine detokenises only when stop strings need text: the gateway sends token ids and
detokenises itself, and `skip_special_tokens` / `spaces_between_special_tokens` shape only that
text, which this protocol does not carry.
"""

from __future__ import annotations

from dataclasses import dataclass

from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from phasescope.engine.request import ModelLimits, ParsedInput, SamplingSpec
from phasescope.errors import InvalidRequestError
from phasescope.serve.validation import (
    SamplingAsk,
    check_prompt_chars,
    check_sampling,
    check_token_ids,
    structured_output,
)


@dataclass(frozen=True, slots=True)
class EngineProtocolRequest:
    """A Generate request as the engine will run it."""

    request_id: str
    parsed: ParsedInput
    stream: bool
    sampling: pb.SamplingParams


def parse_generate(request: pb.GenerateRequest, limits: ModelLimits, data_parallel_size: int) -> EngineProtocolRequest:
    """The request's input and its sampling message, or INVALID_ARGUMENT naming what cannot be served."""
    if not request.request_id:
        raise InvalidRequestError("request_id", "must not be empty: Abort finds a request by it")
    for field in ("mm_inputs", "media_refs"):
        if request.HasField(field):
            raise InvalidRequestError(field, "this worker serves a text model: multimodal inputs are not supported")
    if request.extra_mm_inputs:
        raise InvalidRequestError(
            "extra_mm_inputs", "this worker serves a text model: multimodal inputs are not supported"
        )
    if request.HasField("kv_transfer_params") or request.HasField("kv_transfer_params_json"):
        field = "kv_transfer_params" if request.HasField("kv_transfer_params") else "kv_transfer_params_json"
        raise InvalidRequestError(field, "prefill/decode disaggregation is not supported by this worker")
    if request.HasField("data_parallel_rank") and not 0 <= request.data_parallel_rank < data_parallel_size:
        raise InvalidRequestError(
            "data_parallel_rank",
            f"must be in [0, {data_parallel_size}) on this worker, got {request.data_parallel_rank}",
        )
    kind = request.WhichOneof("input")
    if kind == "tokenized":
        token_ids = tuple(request.tokenized.input_ids)
        if not token_ids:
            raise InvalidRequestError("tokenized.input_ids", "must not be empty")
        check_token_ids(token_ids, "tokenized.input_ids", limits)
        parsed = ParsedInput("token_ids", token_ids=token_ids)
    elif kind == "text":
        if not request.text:
            raise InvalidRequestError("text", "must not be empty")
        check_prompt_chars(len(request.text), limits, "text")
        parsed = ParsedInput("prompt", prompt=request.text)
    else:
        raise InvalidRequestError("input", "one of tokenized or text is required")
    return EngineProtocolRequest(request.request_id, parsed, request.stream, request.sampling_params)


def build_sampling(sampling: pb.SamplingParams, prompt_tokens: int, limits: ModelLimits) -> SamplingSpec:
    """The sampling message validated against the prompt and the model, in this protocol's field names."""
    prefix = "sampling_params."
    ask = SamplingAsk(
        max_tokens=sampling.max_tokens if sampling.HasField("max_tokens") else None,
        temperature=sampling.temperature if sampling.HasField("temperature") else None,
        top_p=sampling.top_p or None,
        top_k=sampling.top_k or None,
        min_p=sampling.min_p or None,
        seed=sampling.seed if sampling.HasField("seed") else None,
        stop=sampling.stop,
        stop_token_ids=sampling.stop_token_ids,
        presence_penalty=sampling.presence_penalty or None,
        frequency_penalty=sampling.frequency_penalty or None,
        repetition_penalty=sampling.repetition_penalty or None,
        ignore_eos=sampling.ignore_eos,
        min_tokens=sampling.min_tokens,
        logit_bias=tuple(sampling.logit_bias.items()),
        include_stop_str_in_output=sampling.include_stop_str_in_output,
        # As vLLM's servicer passes them: they shape only text, which this protocol carries only for stop strings.
        skip_special_tokens=sampling.skip_special_tokens,
        spaces_between_special_tokens=sampling.spaces_between_special_tokens,
        structured=structured_output(sampling, sampling.WhichOneof("constraint"), prefix),
        logprobs=sampling.logprobs if sampling.HasField("logprobs") else None,
        prompt_logprobs=sampling.prompt_logprobs if sampling.HasField("prompt_logprobs") else None,
        # 0 is "not set", as vLLM's servicer reads it (n > 0 else 1).
        n=sampling.n or None,
    )
    # Text only where stop strings need it: the gateway detokenises itself (vLLM's servicer does the same).
    # max_tokens beyond the context is served as vLLM's worker serves it (gateways send the context's size).
    return check_sampling(
        ask, prefix, prompt_tokens, limits, detokenize=bool(sampling.stop), max_tokens_past_context=True
    )
