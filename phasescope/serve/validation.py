"""Request validation: every check a request must pass before it reaches the engine.

Pure functions over the generated messages and the model's limits, so each
bad-input case is tested without an engine. Every error names the field.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from google.protobuf.message import Message

from phasescope.engine.request import ChatTurn, ModelLimits, ParsedInput, SamplingSpec
from phasescope.errors import InvalidRequestError
from phasescope.v1 import inference_pb2 as pb

CHAT_ROLES = ("system", "user", "assistant", "tool")
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_REQUEST_ID_CHARS = 256

# Top-level field numbers of the `input` oneof in GenerateRequest and TokenizeRequest.
_GENERATE_INPUT_FIELDS = frozenset({2, 3, 4})
_TOKENIZE_INPUT_FIELDS = frozenset({1, 2})


class UndecodableRequest:
    """Stands in for a request whose bytes could not be read as the declared message."""

    def __init__(self, field: str, reason: str) -> None:
        self.field = field
        self.reason = reason


def _top_level_fields(data: bytes) -> set[int] | None:
    """Field numbers present at the top level of a protobuf message; None if malformed."""
    seen: set[int] = set()
    position, end = 0, len(data)

    def varint() -> int | None:
        nonlocal position
        shift = value = 0
        while position < end and shift < 64:
            byte = data[position]
            position += 1
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return value
            shift += 7
        return None

    while position < end:
        tag = varint()
        if tag is None:
            return None
        number, wire_type = tag >> 3, tag & 7
        seen.add(number)
        if wire_type == 0:
            if varint() is None:
                return None
        elif wire_type == 1:
            position += 8
        elif wire_type == 2:
            length = varint()
            if length is None:
                return None
            position += length
        elif wire_type == 5:
            position += 4
        else:
            return None
        if position > end:
            return None
    return seen


def _check_decoded(message: Message, data: bytes, input_fields: frozenset[int]) -> UndecodableRequest | None:
    try:
        message.ParseFromString(data)
    except Exception as exc:  # protobuf raises DecodeError and, for bad UTF-8, others
        return UndecodableRequest("request", f"not a valid {message.DESCRIPTOR.full_name}: {exc}")
    fields = _top_level_fields(data) or set()
    # A oneof keeps only the last member sent; a client that sent two meant
    # something the server cannot honour, so refuse instead of guessing.
    if len(fields & input_fields) > 1:
        return UndecodableRequest("input", "more than one of the input kinds was sent; send exactly one")
    return None


def decode_watch_request(data: bytes) -> pb.WatchTelemetryRequest | UndecodableRequest:
    message = pb.WatchTelemetryRequest()
    return _check_decoded(message, data, frozenset()) or message


def decode_generate_request(data: bytes) -> pb.GenerateRequest | UndecodableRequest:
    message = pb.GenerateRequest()
    return _check_decoded(message, data, _GENERATE_INPUT_FIELDS) or message


def decode_tokenize_request(data: bytes) -> pb.TokenizeRequest | UndecodableRequest:
    message = pb.TokenizeRequest()
    return _check_decoded(message, data, _TOKENIZE_INPUT_FIELDS) or message


def parse_chat(chat: pb.Chat, field: str) -> tuple[ChatTurn, ...]:
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


def check_token_ids(token_ids: Sequence[int], field: str, limits: ModelLimits) -> None:
    for index, token_id in enumerate(token_ids):
        if not 0 <= token_id < limits.vocab_size:
            raise InvalidRequestError(
                f"{field}[{index}]",
                f"token id {token_id} is outside the vocabulary (0 to {limits.vocab_size - 1})",
            )


def parse_generate_input(request: pb.GenerateRequest, limits: ModelLimits) -> ParsedInput:
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
        chat = parse_chat(request.chat, "chat")
        check_prompt_chars(sum(len(turn.content) for turn in chat), limits, "chat")
        return ParsedInput("chat", chat=chat)
    if not request.token_ids.ids:
        raise InvalidRequestError("token_ids.ids", "must not be empty")
    check_token_ids(request.token_ids.ids, "token_ids.ids", limits)
    return ParsedInput("token_ids", token_ids=tuple(request.token_ids.ids))


def parse_tokenize_input(request: pb.TokenizeRequest) -> ParsedInput:
    kind = request.WhichOneof("input")
    if kind is None:
        raise InvalidRequestError("input", "one of text or chat is required")
    if kind == "text":
        return ParsedInput("prompt", prompt=request.text)
    return ParsedInput("chat", chat=parse_chat(request.chat, "chat"))


def check_prompt_chars(chars: int, limits: ModelLimits, field: str) -> None:
    """Refuse text that cannot fit in the context before paying to tokenise it.

    No token spans more than `max_chars_per_token` characters, so a prompt of n
    tokens has at most n × that many; one that needs more than the context leaves
    is refused unread (vLLM's renderer makes the same check). This bounds the
    tokenising work any one request can ask for, whatever the message size limit.
    """
    most = (limits.max_model_len - 1) * limits.max_chars_per_token
    if chars > most:
        raise InvalidRequestError(
            field,
            f"{chars} characters cannot fit in the context window of {limits.max_model_len} tokens "
            f"(no token of this model spans more than {limits.max_chars_per_token} characters, "
            f"so at most {most} fit)",
        )


def check_prompt_length(prompt_tokens: int, limits: ModelLimits, field: str) -> None:
    if prompt_tokens == 0:
        raise InvalidRequestError(field, "renders to no tokens")
    if prompt_tokens >= limits.max_model_len:
        raise InvalidRequestError(
            field,
            f"{prompt_tokens} prompt tokens leave no room for output in the context window "
            f"of {limits.max_model_len} tokens",
        )


def _finite(value: float, field: str) -> float:
    if not math.isfinite(value):
        raise InvalidRequestError(field, f"must be a finite number, got {value}")
    return value


def build_sampling(
    sampling: pb.SamplingParams,
    prompt_tokens: int,
    limits: ModelLimits,
    *,
    token_ids_only: bool = False,
    stream_interval: int = 0,
) -> SamplingSpec:
    """Validate the sampling message against the prompt's length and the model's limits
    (`token_ids_only`: the request's GenerateRequest.token_ids_only)."""
    room = limits.max_model_len - prompt_tokens
    if sampling.HasField("max_tokens"):
        max_tokens = sampling.max_tokens
        if max_tokens < 1:
            raise InvalidRequestError("sampling.max_tokens", "must be at least 1")
        if max_tokens > room:
            raise InvalidRequestError(
                "sampling.max_tokens",
                f"{max_tokens} output tokens plus {prompt_tokens} prompt tokens exceed the context "
                f"window of {limits.max_model_len} tokens (at most {room} fit)",
            )
    else:
        max_tokens = room

    temperature = top_p = min_p = presence = frequency = repetition = None
    if sampling.HasField("temperature"):
        temperature = _finite(sampling.temperature, "sampling.temperature")
        if temperature < 0:
            raise InvalidRequestError("sampling.temperature", f"must be 0 (greedy) or more, got {temperature}")
    if sampling.HasField("top_p"):
        top_p = _finite(sampling.top_p, "sampling.top_p")
        if not 0 < top_p <= 1:
            raise InvalidRequestError("sampling.top_p", f"must be in (0, 1], got {top_p}")
    top_k: int | None = None
    if sampling.HasField("top_k"):
        top_k = sampling.top_k
        if top_k < -1:
            raise InvalidRequestError("sampling.top_k", f"must be -1 or 0 (disabled) or positive, got {top_k}")
    if sampling.HasField("min_p"):
        min_p = _finite(sampling.min_p, "sampling.min_p")
        if not 0 <= min_p <= 1:
            raise InvalidRequestError("sampling.min_p", f"must be in [0, 1], got {min_p}")
    if sampling.HasField("presence_penalty"):
        presence = _finite(sampling.presence_penalty, "sampling.presence_penalty")
        if not -2 <= presence <= 2:
            raise InvalidRequestError("sampling.presence_penalty", f"must be in [-2, 2], got {presence}")
    if sampling.HasField("frequency_penalty"):
        frequency = _finite(sampling.frequency_penalty, "sampling.frequency_penalty")
        if not -2 <= frequency <= 2:
            raise InvalidRequestError("sampling.frequency_penalty", f"must be in [-2, 2], got {frequency}")
    if sampling.HasField("repetition_penalty"):
        repetition = _finite(sampling.repetition_penalty, "sampling.repetition_penalty")
        if repetition <= 0:
            raise InvalidRequestError("sampling.repetition_penalty", f"must be greater than 0, got {repetition}")

    if len(sampling.stop) > MAX_STOP_STRINGS:
        raise InvalidRequestError("sampling.stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(sampling.stop)}")
    for index, stop in enumerate(sampling.stop):
        if not stop:
            raise InvalidRequestError(f"sampling.stop[{index}]", "must not be empty")
        if len(stop) > MAX_STOP_STRING_CHARS:
            raise InvalidRequestError(f"sampling.stop[{index}]", f"longer than {MAX_STOP_STRING_CHARS} characters")
    if len(sampling.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequestError("sampling.stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} stop token ids")
    check_token_ids(sampling.stop_token_ids, "sampling.stop_token_ids", limits)
    if token_ids_only and sampling.stop:
        raise InvalidRequestError(
            "token_ids_only",
            "stop strings are matched against text, which token_ids_only skips: drop sampling.stop "
            "or use sampling.stop_token_ids",
        )

    return SamplingSpec(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        seed=sampling.seed if sampling.HasField("seed") else None,
        stop=tuple(sampling.stop),
        stop_token_ids=tuple(sampling.stop_token_ids),
        presence_penalty=presence,
        frequency_penalty=frequency,
        repetition_penalty=repetition,
        ignore_eos=sampling.ignore_eos,
        detokenize=not token_ids_only,
        stream_interval=stream_interval or None,
    )
