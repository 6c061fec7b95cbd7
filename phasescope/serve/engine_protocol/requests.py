"""vLLM's engine-protocol `GenerateRequest`, decoded into the request path's `GenerationAsk` or refused.

What the engine cannot do is refused with INVALID_ARGUMENT naming the field (never silently
ignored). The protocol's sampling fields are plain proto3 scalars, so 0 means "not set" for
them, as vLLM's own servicer reads them (`temperature` and `max_tokens` are `optional` and
read as such); an unset value is the model's default, as on phasescope.v1. As vLLM's servicer
does, the engine detokenises only when stop strings need text: the gateway sends token ids and
detokenises itself, and `skip_special_tokens` / `spaces_between_special_tokens` shape only that
text, which this protocol does not carry. KV-transfer parameters (disaggregated prefill and decode) pass
through to the engine's connector as vLLM's servicer passes them.
"""

from __future__ import annotations

from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_servicer.vllm.kv_transfer import params_from_request

from phasescope.engine.request import KvTransfer, ModelLimits, ParsedInput, SamplingSpec
from phasescope.errors import InvalidRequestError
from phasescope.serve.path import GenerationAsk
from phasescope.serve.validation import (
    SamplingAsk,
    UndecodableRequest,
    check_prompt_chars,
    check_token_ids,
    structured_output,
)

PREFIX = "sampling_params."


ADAPTER_METADATA_KEY = "phasescope-adapter"
"""The gRPC metadata key that selects a LoRA adapter on vLLM's engine protocol, whose GenerateRequest has no field
for one (smg 1.13 sends none: a client of the protocol sets it itself)."""


def decode_generate(
    request: pb.GenerateRequest | UndecodableRequest, limits: ModelLimits, data_parallel_size: int, adapter: str = ""
) -> GenerationAsk:
    """The request as the request path takes it, or INVALID_ARGUMENT naming what cannot be served; `adapter`: the
    LoRA adapter its metadata (ADAPTER_METADATA_KEY) names."""
    if isinstance(request, UndecodableRequest):
        raise InvalidRequestError(request.field, request.reason)
    for field in ("mm_inputs", "media_refs"):
        if request.HasField(field):
            raise InvalidRequestError(field, "this worker serves a text model: multimodal inputs are not supported")
    if request.extra_mm_inputs:
        raise InvalidRequestError(
            "extra_mm_inputs", "this worker serves a text model: multimodal inputs are not supported"
        )
    kv_transfer = decode_kv_transfer(request)
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
    sampling = request.sampling_params
    return GenerationAsk(
        input=parsed,
        sampling=sampling_ask(sampling),
        input_field="tokenized.input_ids" if kind == "tokenized" else "text",
        sampling_prefix=PREFIX,
        request_id=request.request_id,
        truncate_prompt_tokens=sampling.truncate_prompt_tokens if sampling.HasField("truncate_prompt_tokens") else None,
        # Text only where stop strings need it: the gateway detokenises itself (vLLM's servicer does the same).
        detokenize=bool(sampling.stop),
        # Gateways send max_tokens at the context's size: the engine stops at its end, as vLLM's worker lets it.
        max_tokens_past_context=True,
        abortable=True,
        kv_transfer=kv_transfer,
        adapter=adapter,
        adapter_field=f"metadata {ADAPTER_METADATA_KEY}",
    )


def decode_kv_transfer(request: pb.GenerateRequest) -> KvTransfer | None:
    """The request's KV-transfer parameters as vLLM's servicer reads them (smg-grpc-servicer's
    `params_from_request`: the JSON field first, a JSON object; else the typed one, a host and a port), or
    INVALID_ARGUMENT naming the field. None when there are none, or they are empty: vLLM's servicer hands the
    engine nothing then either."""
    field = "kv_transfer_params_json" if request.HasField("kv_transfer_params_json") else "kv_transfer_params"
    try:
        params = params_from_request(request)
    except ValueError as exc:
        raise InvalidRequestError(field, str(exc)) from exc
    return KvTransfer(params, field) if params else None


def sampling_ask(sampling: pb.SamplingParams) -> SamplingAsk:
    """The protocol's sampling message as asked (validated by the request path)."""
    return SamplingAsk(
        max_tokens=sampling.max_tokens if sampling.HasField("max_tokens") else None,
        temperature=sampling.temperature if sampling.HasField("temperature") else None,
        top_p=sampling.top_p or None,
        top_k=sampling.top_k or None,
        min_p=sampling.min_p or None,
        seed=sampling.seed if sampling.HasField("seed") else None,
        stop=tuple(sampling.stop),
        stop_token_ids=tuple(sampling.stop_token_ids),
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
        structured=structured_output(sampling, sampling.WhichOneof("constraint"), PREFIX),
        logprobs=sampling.logprobs if sampling.HasField("logprobs") else None,
        prompt_logprobs=sampling.prompt_logprobs if sampling.HasField("prompt_logprobs") else None,
        # 0 is "not set", as vLLM's servicer reads it (n > 0 else 1).
        n=sampling.n or None,
    )


def sampling_message(spec: SamplingSpec) -> pb.SamplingParams:
    """A validated spec as this protocol's sampling message (what phasescope.v1 sends smg's Rust server beside it):
    `sampling_ask` reads it back as the same values. What the protocol cannot carry is refused naming the field
    the phasescope.v1 request set (`sampling.` + its name)."""
    if spec.bad_words:
        raise InvalidRequestError("sampling.bad_words", "is not served behind smg's Rust request path")
    if spec.seed is not None and not -(2**31) <= spec.seed < 2**31:
        raise InvalidRequestError("sampling.seed", "must fit 32 bits behind smg's Rust request path")
    message = pb.SamplingParams(
        temperature=spec.temperature,
        top_p=spec.top_p or 0.0,
        top_k=spec.top_k if spec.top_k is not None and spec.top_k > 0 else 0,
        min_p=spec.min_p or 0.0,
        frequency_penalty=spec.frequency_penalty or 0.0,
        presence_penalty=spec.presence_penalty or 0.0,
        repetition_penalty=spec.repetition_penalty or 0.0,
        max_tokens=spec.max_tokens,
        min_tokens=spec.min_tokens,
        stop=spec.stop,
        stop_token_ids=spec.stop_token_ids,
        skip_special_tokens=spec.skip_special_tokens,
        spaces_between_special_tokens=spec.spaces_between_special_tokens,
        ignore_eos=spec.ignore_eos,
        n=spec.n,
        logprobs=spec.logprobs,
        prompt_logprobs=spec.prompt_logprobs,
        seed=spec.seed,
        include_stop_str_in_output=spec.include_stop_str_in_output,
        logit_bias=dict(spec.logit_bias),
    )
    structured = spec.structured
    if structured is not None:
        if structured.kind == "choice":
            message.choice.choices.extend(structured.choices)
        elif structured.kind == "json_object":
            message.json_object = True
        else:
            setattr(message, structured.kind, structured.value)
    return message
