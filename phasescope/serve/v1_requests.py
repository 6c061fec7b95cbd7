"""phasescope.v1's requests, decoded: bytes into its messages, its messages into the request path's values, or refused.

The deserializers (`deserialize_generate`, `deserialize_tokenize`, `deserialize_watch`) turn bytes they cannot read,
or two members of the `input` oneof, into an `UndecodableRequest` the handler answers INVALID_ARGUMENT.
`decode_generate` reads a GenerateRequest into the request path's `GenerationAsk`, `decode_tokenize` a
TokenizeRequest into the input to tokenise. Every sampling field is proto3 `optional`: unset is the model's
default. Every refusal names the field as phasescope.v1 spells it. The rules both protocols share (the sampling
bounds, the prompt's length) are `phasescope.serve.validation`'s; vLLM's engine protocol decodes its own in
`phasescope.serve.engine_protocol.requests`.
"""

from __future__ import annotations

from phasescope.engine.request import ChatTurn, ModelLimits, ParsedInput, StructuredOutput
from phasescope.errors import InvalidRequestError
from phasescope.serve.path import GenerationAsk
from phasescope.serve.validation import (
    SamplingAsk,
    UndecodableRequest,
    check_prompt_chars,
    check_token_ids,
    decoder,
    structured_output,
)
from phasescope.v1 import inference_pb2 as pb

CHAT_ROLES = ("system", "user", "assistant", "tool")
MAX_REQUEST_ID_CHARS = 256
PREFIX = "sampling."

# Top-level field numbers of the `input` oneof in GenerateRequest and TokenizeRequest.
_GENERATE_INPUT_FIELDS = frozenset({2, 3, 4})
_TOKENIZE_INPUT_FIELDS = frozenset({1, 2})

deserialize_watch = decoder(pb.WatchTelemetryRequest)
deserialize_generate = decoder(pb.GenerateRequest, _GENERATE_INPUT_FIELDS)
deserialize_tokenize = decoder(pb.TokenizeRequest, _TOKENIZE_INPUT_FIELDS)


def decode_generate(request: pb.GenerateRequest | UndecodableRequest, limits: ModelLimits) -> GenerationAsk:
    """The request as the request path takes it, or INVALID_ARGUMENT naming what cannot be served."""
    if isinstance(request, UndecodableRequest):
        raise InvalidRequestError(request.field, request.reason)
    parsed = decode_generate_input(request, limits)
    sampling = request.sampling
    if request.token_ids_only and sampling.stop:
        raise InvalidRequestError(
            "token_ids_only",
            "stop strings are matched against text, which token_ids_only skips: drop sampling.stop "
            "or use sampling.stop_token_ids",
        )
    return GenerationAsk(
        input=parsed,
        sampling=sampling_ask(sampling),
        input_field=parsed.kind,
        sampling_prefix=PREFIX,
        request_id=request.request_id,
        truncate_prompt_tokens=sampling.truncate_prompt_tokens if sampling.HasField("truncate_prompt_tokens") else None,
        detokenize=not request.token_ids_only,
        stream_interval=request.stream_interval or None,
        adapter=request.adapter,
    )


def decode_tokenize(request: pb.TokenizeRequest | UndecodableRequest) -> ParsedInput:
    """The text or chat to tokenise, or INVALID_ARGUMENT naming what is missing or wrong."""
    if isinstance(request, UndecodableRequest):
        raise InvalidRequestError(request.field, request.reason)
    kind = request.WhichOneof("input")
    if kind is None:
        raise InvalidRequestError("input", "one of text or chat is required")
    if kind == "text":
        return ParsedInput("prompt", prompt=request.text)
    return ParsedInput("chat", chat=decode_chat(request.chat, "chat"))


def decode_generate_input(request: pb.GenerateRequest, limits: ModelLimits) -> ParsedInput:
    """The request's id checked and its prompt, chat or token ids read; text that cannot fit the context is
    refused before it is tokenised."""
    if len(request.request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequestError("request_id", f"longer than {MAX_REQUEST_ID_CHARS} characters")
    kind = request.WhichOneof("input")
    if kind is None:
        raise InvalidRequestError("input", "one of prompt, chat or token_ids is required")
    if kind == "prompt":
        if not request.prompt:
            raise InvalidRequestError("prompt", "must not be empty")
        check_prompt_chars(len(request.prompt), limits, "prompt")
        return ParsedInput("prompt", prompt=request.prompt)
    if kind == "chat":
        chat = decode_chat(request.chat, "chat")
        check_prompt_chars(sum(len(turn.content) for turn in chat), limits, "chat")
        return ParsedInput("chat", chat=chat)
    if not request.token_ids.ids:
        raise InvalidRequestError("token_ids.ids", "must not be empty")
    check_token_ids(request.token_ids.ids, "token_ids.ids", limits)
    return ParsedInput("token_ids", token_ids=tuple(request.token_ids.ids))


def decode_chat(chat: pb.Chat, field: str) -> tuple[ChatTurn, ...]:
    """A chat's turns, each with a role this server knows; `field` is the chat's path in the request."""
    if not chat.messages:
        raise InvalidRequestError(f"{field}.messages", "must hold at least one message")
    turns: list[ChatTurn] = []
    for index, message in enumerate(chat.messages):
        if message.role not in CHAT_ROLES:
            raise InvalidRequestError(
                f"{field}.messages[{index}].role",
                f"unknown role {message.role!r}; expected one of {', '.join(CHAT_ROLES)}",
            )
        turns.append(ChatTurn(message.role, message.content))
    return tuple(turns)


def sampling_ask(sampling: pb.SamplingParams) -> SamplingAsk:
    """The protocol's sampling message as asked (validated by the request path); unset is None, the model's
    default, except where a bool's default is true."""
    has = sampling.HasField
    return SamplingAsk(
        max_tokens=sampling.max_tokens if has("max_tokens") else None,
        temperature=sampling.temperature if has("temperature") else None,
        top_p=sampling.top_p if has("top_p") else None,
        top_k=sampling.top_k if has("top_k") else None,
        min_p=sampling.min_p if has("min_p") else None,
        seed=sampling.seed if has("seed") else None,
        stop=tuple(sampling.stop),
        stop_token_ids=tuple(sampling.stop_token_ids),
        presence_penalty=sampling.presence_penalty if has("presence_penalty") else None,
        frequency_penalty=sampling.frequency_penalty if has("frequency_penalty") else None,
        repetition_penalty=sampling.repetition_penalty if has("repetition_penalty") else None,
        ignore_eos=sampling.ignore_eos,
        min_tokens=sampling.min_tokens,
        logit_bias=tuple(sampling.logit_bias.items()),
        include_stop_str_in_output=sampling.include_stop_str_in_output,
        skip_special_tokens=sampling.skip_special_tokens if has("skip_special_tokens") else True,
        spaces_between_special_tokens=(
            sampling.spaces_between_special_tokens if has("spaces_between_special_tokens") else True
        ),
        structured=decode_structured(sampling) if has("structured") else None,
        logprobs=sampling.logprobs if has("logprobs") else None,
        prompt_logprobs=sampling.prompt_logprobs if has("prompt_logprobs") else None,
        bad_words=tuple(sampling.bad_words),
        n=sampling.n if has("n") else None,
    )


def decode_structured(sampling: pb.SamplingParams) -> StructuredOutput | None:
    """The structured output a set `sampling.structured` asks for; set with none of its kinds is refused."""
    kind = sampling.structured.WhichOneof("kind")
    if kind is None:
        raise InvalidRequestError("sampling.structured", "set one of its kinds, or leave it unset for free text")
    return structured_output(sampling.structured, kind, "sampling.structured.")
