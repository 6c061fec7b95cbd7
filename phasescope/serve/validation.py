"""The request rules both protocols share, and the tolerant deserializer each protocol's handlers use.

Each protocol decodes its own messages into the values these rules take: `phasescope.serve.v1_requests` and
vLLM's engine protocol's `phasescope.serve.engine_protocol.requests`. What is here reads no protocol's messages:
the sampling a request asked for (`SamplingAsk`) validated against the prompt and the model's limits
(`build_sampling`), the prompt's size before and after tokenising (`check_prompt_chars`, `truncate_prompt`,
`check_prompt_length`), token ids against the vocabulary, a structured-output oneof both protocols spell alike
(`structured_output`), and `decoder`, which turns bytes a protocol's message cannot be read from into an
`UndecodableRequest`. Pure functions, so each bad-input case is tested without an engine. Every error names
the field, as the request's protocol spells it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar, get_args

from google.protobuf.message import Message

from phasescope.engine.request import (
    KvTransfer,
    ModelLimits,
    SamplingSpec,
    StructuredKind,
    StructuredOutput,
)
from phasescope.errors import InvalidRequestError

MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
# Bad words are bounded as stop strings are: both are matched against the output on every step.
MAX_BAD_WORDS = MAX_STOP_STRINGS
MAX_BAD_WORD_CHARS = MAX_STOP_STRING_CHARS
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIASES = 1024
MAX_CHOICES = 1024
# OpenAI's and vLLM's bound on a logit bias.
MAX_LOGIT_BIAS = 100.0
MAX_SAMPLES = 128
"""`n` at most: each sample is a sequence in the engine's batch, so one request cannot ask for more than a
large batch (vLLM's own bound is 16384)."""

M = TypeVar("M", bound=Message)


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


def decoder(
    message_type: type[M], input_fields: frozenset[int] = frozenset()
) -> Callable[[bytes], M | UndecodableRequest]:
    """A request deserializer for `message_type` that turns bytes it cannot read (or two members of
    the oneof whose field numbers are `input_fields`) into an `UndecodableRequest`, which the handler
    answers INVALID_ARGUMENT, instead of the INTERNAL status gRPC gives a failing deserializer."""

    def decode(data: bytes) -> M | UndecodableRequest:
        message = message_type()
        return _check_decoded(message, data, input_fields) or message

    return decode


def check_token_ids(token_ids: Sequence[int], field: str, limits: ModelLimits) -> None:
    for index, token_id in enumerate(token_ids):
        if not 0 <= token_id < limits.vocab_size:
            raise InvalidRequestError(
                f"{field}[{index}]",
                f"token id {token_id} is outside the vocabulary (0 to {limits.vocab_size - 1})",
            )


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


def truncate_prompt(prompt: list[int], keep: int | None, limits: ModelLimits, field: str) -> list[int]:
    """The prompt's last `keep` tokens (vLLM's truncate_prompt_tokens); -1 keeps as many as leave room for one
    output token; None keeps it whole. Text is still bounded by `check_prompt_chars` before it is tokenised."""
    if keep is None:
        return prompt
    if keep == -1:
        keep = limits.max_model_len - 1
    if keep < 1:
        raise InvalidRequestError(field, f"must be -1 (the context window less one token) or at least 1, got {keep}")
    return prompt[-keep:] if len(prompt) > keep else prompt


def check_prompt_length(prompt_tokens: int, limits: ModelLimits, field: str) -> None:
    if prompt_tokens == 0:
        raise InvalidRequestError(field, "renders to no tokens")
    if prompt_tokens >= limits.max_model_len:
        raise InvalidRequestError(
            field,
            f"{prompt_tokens} prompt tokens leave no room for output in the context window "
            f"of {limits.max_model_len} tokens",
        )


def _finite(prefix: str, name: str, value: float | None) -> float | None:
    if value is not None and not math.isfinite(value):
        raise InvalidRequestError(f"{prefix}{name}", f"must be a finite number, got {value}")
    return value


@dataclass(frozen=True, slots=True)
class SamplingAsk:
    """Sampling values as a request asked for them, whichever protocol: None is "not asked" (the
    model's default); `build_sampling` validates them."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    logit_bias: Sequence[tuple[int, float]] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured: StructuredOutput | None = None
    """Its `field` is the request's own name for it (the error names it)."""
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    bad_words: Sequence[str] = ()
    n: int | None = None


def structured_output(message: Message, kind: str | None, field: str) -> StructuredOutput | None:
    """A structured-output oneof as the engine's constraint (None: none asked). Both protocols name its
    cases alike (json_schema, json_object, regex, grammar, choice with its `choices`, structural_tag):
    `kind` is the case set, `field` the oneof's path as the protocol spells it, which refusals name."""
    if kind is None:
        return None
    field = f"{field}{kind}"
    if kind == "choice":
        choices = tuple(getattr(message, "choice").choices)  # noqa: B009  # both protocols' messages have it
        return StructuredOutput("choice", choices=choices, field=f"{field}.choices")
    if kind == "json_object":
        # false asks for nothing, as vLLM's servicer reads it
        return StructuredOutput("json_object", field=field) if getattr(message, kind) else None
    if kind not in get_args(StructuredKind):
        raise InvalidRequestError(field, "is not a structured output this server knows")
    named: StructuredKind = kind  # type: ignore[assignment]  # checked just above
    return StructuredOutput(named, value=str(getattr(message, kind)), field=field)


def check_structured(structured: StructuredOutput) -> StructuredOutput:
    """What can be refused before the engine's grammar compiler sees it (which refuses the rest, with
    its own message): a schema that is not JSON, an empty pattern, no choices."""
    field = structured.field
    if structured.kind in ("json_schema", "structural_tag"):
        try:
            json.loads(structured.value)
        except ValueError as exc:
            raise InvalidRequestError(field, f"is not valid JSON: {exc}") from exc
    elif structured.kind in ("regex", "grammar") and not structured.value:
        raise InvalidRequestError(field, "must not be empty")
    elif structured.kind == "choice":
        if not structured.choices:
            raise InvalidRequestError(field, "must list at least one choice")
        if len(structured.choices) > MAX_CHOICES:
            raise InvalidRequestError(field, f"at most {MAX_CHOICES} choices, got {len(structured.choices)}")
        for index, choice in enumerate(structured.choices):
            if not choice:
                raise InvalidRequestError(f"{field}[{index}]", "must not be empty")
    return structured


def build_sampling(
    ask: SamplingAsk,
    prefix: str,
    prompt_tokens: int,
    limits: ModelLimits,
    *,
    detokenize: bool = True,
    stream_interval: int | None = None,
    max_tokens_past_context: bool = False,
    kv_transfer: KvTransfer | None = None,
) -> SamplingSpec:
    """Validate sampling values against the prompt's length and the model's limits; each error names
    the field as the request's protocol spells it (`prefix` + the field's name). With
    `max_tokens_past_context` (vLLM's engine protocol, as vLLM's worker does) a max_tokens beyond the room
    left in the context is the engine's to cut: it stops at the context's end with finish reason "length"."""
    room = limits.max_model_len - prompt_tokens
    max_tokens = room
    if ask.max_tokens is not None:
        max_tokens = ask.max_tokens
        if max_tokens < 1:
            raise InvalidRequestError(f"{prefix}max_tokens", "must be at least 1")
        if max_tokens > room and not max_tokens_past_context:
            raise InvalidRequestError(
                f"{prefix}max_tokens",
                f"{max_tokens} output tokens plus {prompt_tokens} prompt tokens exceed the context "
                f"window of {limits.max_model_len} tokens (at most {room} fit)",
            )

    def refuse(name: str, message: str) -> None:
        raise InvalidRequestError(f"{prefix}{name}", message)

    temperature = _finite(prefix, "temperature", ask.temperature)
    if temperature is not None and temperature < 0:
        refuse("temperature", f"must be 0 (greedy) or more, got {temperature}")
    top_p = _finite(prefix, "top_p", ask.top_p)
    if top_p is not None and not 0 < top_p <= 1:
        refuse("top_p", f"must be in (0, 1], got {top_p}")
    if ask.top_k is not None and ask.top_k < -1:
        refuse("top_k", f"must be -1 or 0 (disabled) or positive, got {ask.top_k}")
    min_p = _finite(prefix, "min_p", ask.min_p)
    if min_p is not None and not 0 <= min_p <= 1:
        refuse("min_p", f"must be in [0, 1], got {min_p}")
    presence = _finite(prefix, "presence_penalty", ask.presence_penalty)
    if presence is not None and not -2 <= presence <= 2:
        refuse("presence_penalty", f"must be in [-2, 2], got {presence}")
    frequency = _finite(prefix, "frequency_penalty", ask.frequency_penalty)
    if frequency is not None and not -2 <= frequency <= 2:
        refuse("frequency_penalty", f"must be in [-2, 2], got {frequency}")
    repetition = _finite(prefix, "repetition_penalty", ask.repetition_penalty)
    if repetition is not None and repetition <= 0:
        refuse("repetition_penalty", f"must be greater than 0, got {repetition}")

    if len(ask.stop) > MAX_STOP_STRINGS:
        refuse("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(ask.stop)}")
    for index, stop in enumerate(ask.stop):
        if not stop:
            refuse(f"stop[{index}]", "must not be empty")
        if len(stop) > MAX_STOP_STRING_CHARS:
            refuse(f"stop[{index}]", f"longer than {MAX_STOP_STRING_CHARS} characters")
    if len(ask.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        refuse("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} stop token ids")
    check_token_ids(ask.stop_token_ids, f"{prefix}stop_token_ids", limits)

    if ask.min_tokens < 0:
        refuse("min_tokens", f"must be 0 or more, got {ask.min_tokens}")
    if ask.min_tokens > max_tokens:
        refuse("min_tokens", f"must be at most max_tokens ({max_tokens}), got {ask.min_tokens}")
    if len(ask.logit_bias) > MAX_LOGIT_BIASES:
        refuse("logit_bias", f"at most {MAX_LOGIT_BIASES} tokens, got {len(ask.logit_bias)}")
    for token, bias in ask.logit_bias:
        if not 0 <= token < limits.vocab_size:
            refuse("logit_bias", f"token id {token} is outside the vocabulary [0, {limits.vocab_size})")
        if not (math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
            refuse(f"logit_bias[{token}]", f"must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias}")
    structured = check_structured(ask.structured) if ask.structured is not None else None
    if len(ask.bad_words) > MAX_BAD_WORDS:
        refuse("bad_words", f"at most {MAX_BAD_WORDS} words, got {len(ask.bad_words)}")
    for index, word in enumerate(ask.bad_words):
        if not word.strip():
            refuse(f"bad_words[{index}]", "must not be empty or blank")
        if len(word) > MAX_BAD_WORD_CHARS:
            refuse(f"bad_words[{index}]", f"longer than {MAX_BAD_WORD_CHARS} characters")
    for name, asked in (("logprobs", ask.logprobs), ("prompt_logprobs", ask.prompt_logprobs)):
        if asked is not None and not 0 <= asked <= limits.max_logprobs:
            refuse(name, f"must be in [0, {limits.max_logprobs}] (the engine's max_logprobs), got {asked}")
    n = 1 if ask.n is None else ask.n
    if not 1 <= n <= MAX_SAMPLES:
        refuse("n", f"must be in [1, {MAX_SAMPLES}], got {n}")
    if n > 1 and temperature == 0:
        # vLLM's rule: greedy samples would all be the same answer.
        refuse("n", f"must be 1 when using greedy sampling (temperature 0), got {n}")

    return SamplingSpec(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=ask.top_k,
        min_p=min_p,
        seed=ask.seed,
        stop=tuple(ask.stop),
        stop_token_ids=tuple(ask.stop_token_ids),
        presence_penalty=presence,
        frequency_penalty=frequency,
        repetition_penalty=repetition,
        ignore_eos=ask.ignore_eos,
        detokenize=detokenize,
        stream_interval=stream_interval,
        min_tokens=ask.min_tokens,
        logit_bias=tuple(sorted(ask.logit_bias)),
        include_stop_str_in_output=ask.include_stop_str_in_output,
        skip_special_tokens=ask.skip_special_tokens,
        spaces_between_special_tokens=ask.spaces_between_special_tokens,
        structured=structured,
        logprobs=ask.logprobs,
        prompt_logprobs=ask.prompt_logprobs,
        bad_words=tuple(ask.bad_words),
        n=n,
        kv_transfer=kv_transfer,
    )
