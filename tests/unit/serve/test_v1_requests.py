"""phasescope.v1's requests decoded (`phasescope.serve.v1_requests`): bytes into its messages, its messages into
the request path's values, each refusal naming the field as phasescope.v1 spells it."""

import pytest

from phasescope.engine.request import ModelLimits, SamplingSpec, StructuredOutput
from phasescope.errors import InvalidRequestError
from phasescope.serve import validation
from phasescope.serve.v1_requests import (
    decode_generate,
    decode_generate_input,
    decode_tokenize,
    deserialize_generate,
    deserialize_tokenize,
)
from phasescope.serve.validation import UndecodableRequest
from phasescope.v1 import inference_pb2 as pb

# At most 99 prompt tokens of at most 8 characters each: 792 characters.
LIMITS = ModelLimits(max_model_len=100, vocab_size=1000, max_chars_per_token=8)


def sampling(**values: object) -> pb.SamplingParams:
    return pb.SamplingParams(**values)  # type: ignore[arg-type]


def build_sampling(
    message: pb.SamplingParams,
    prompt_tokens: int,
    limits: ModelLimits,
    *,
    token_ids_only: bool = False,
    stream_interval: int = 0,
) -> SamplingSpec:
    """phasescope.v1's sampling message as the request path validates it (decoded, then built)."""
    request = pb.GenerateRequest(
        prompt="x", sampling=message, token_ids_only=token_ids_only, stream_interval=stream_interval
    )
    ask = decode_generate(request, limits)
    return validation.build_sampling(
        ask.sampling,
        ask.sampling_prefix,
        prompt_tokens,
        limits,
        detokenize=ask.detokenize,
        stream_interval=ask.stream_interval,
    )


@pytest.mark.parametrize(
    ("request_message", "field"),
    [
        (pb.GenerateRequest(), "input"),
        (pb.GenerateRequest(prompt=""), "prompt"),
        (pb.GenerateRequest(chat=pb.Chat()), "chat.messages"),
        (
            pb.GenerateRequest(
                chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="hi"), pb.ChatMessage(role="wizard")])
            ),
            "chat.messages[1].role",
        ),
        (pb.GenerateRequest(token_ids=pb.TokenIds()), "token_ids.ids"),
        (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 1000])), "token_ids.ids[1]"),
        (pb.GenerateRequest(request_id="x" * 300, prompt="hi"), "request_id"),
        (pb.GenerateRequest(prompt="x" * 793), "prompt"),
        (
            pb.GenerateRequest(
                chat=pb.Chat(
                    messages=[
                        pb.ChatMessage(role="system", content="x" * 400),
                        pb.ChatMessage(role="user", content="y" * 393),
                    ]
                )
            ),
            "chat",
        ),
    ],
)
def test_bad_input_names_its_field(request_message: pb.GenerateRequest, field: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        decode_generate_input(request_message, LIMITS)
    assert caught.value.field == field


def test_text_that_could_still_fit_goes_on_to_be_tokenised() -> None:
    # 792 characters might be 99 tokens: only the tokenizer can tell.
    assert decode_generate_input(pb.GenerateRequest(prompt="x" * 792), LIMITS).prompt == "x" * 792
    chat = pb.Chat(
        messages=[pb.ChatMessage(role="system", content="x" * 400), pb.ChatMessage(role="user", content="y" * 392)]
    )
    assert len(decode_generate_input(pb.GenerateRequest(chat=chat), LIMITS).chat) == 2


def test_text_too_long_for_any_tokenisation_says_why() -> None:
    with pytest.raises(InvalidRequestError) as caught:
        decode_generate_input(pb.GenerateRequest(prompt="x" * 10_000), LIMITS)
    assert str(caught.value) == (
        "prompt: 10000 characters cannot fit in the context window of 100 tokens "
        "(no token of this model spans more than 8 characters, so at most 792 fit)"
    )


def test_each_input_kind_is_parsed() -> None:
    assert decode_generate_input(pb.GenerateRequest(prompt="hi"), LIMITS).prompt == "hi"
    chat = decode_generate_input(
        pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="system", content="be brief")])), LIMITS
    )
    assert chat.kind == "chat"
    assert chat.chat[0].role == "system"
    assert decode_generate_input(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[0, 999])), LIMITS).token_ids == (0, 999)


def test_two_input_kinds_on_the_wire_are_refused() -> None:
    # A typed client cannot send two members of a oneof; raw bytes can.
    data = (
        pb.GenerateRequest(prompt="a").SerializeToString()
        + pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1])).SerializeToString()
    )
    decoded = deserialize_generate(data)
    assert isinstance(decoded, UndecodableRequest)
    assert decoded.field == "input"


def test_garbage_bytes_are_undecodable() -> None:
    decoded = deserialize_generate(b"\xff\xff\xff\xff")
    assert isinstance(decoded, UndecodableRequest)
    assert decoded.field == "request"


def test_invalid_utf8_in_a_stop_string_is_undecodable() -> None:
    good = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(stop=["ab"])).SerializeToString()
    bad = good.replace(b"ab", b"\xc3\x28")
    assert isinstance(deserialize_generate(bad), UndecodableRequest)


def test_well_formed_request_decodes() -> None:
    message = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=3))
    decoded = deserialize_generate(message.SerializeToString())
    assert decoded == message


def test_tokenize_reads_text_or_chat_and_names_what_is_wrong() -> None:
    assert decode_tokenize(pb.TokenizeRequest(text="hi")).prompt == "hi"
    chat = decode_tokenize(pb.TokenizeRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="hi")])))
    assert chat.kind == "chat"
    for request, field in (
        (pb.TokenizeRequest(), "input"),
        (pb.TokenizeRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="wizard")])), "chat.messages[0].role"),
        (UndecodableRequest("request", "not a valid phasescope.v1.TokenizeRequest"), "request"),
    ):
        with pytest.raises(InvalidRequestError) as caught:
            decode_tokenize(request)
        assert caught.value.field == field


def test_two_tokenize_input_kinds_on_the_wire_are_refused() -> None:
    data = pb.TokenizeRequest(text="a").SerializeToString() + pb.TokenizeRequest(chat=pb.Chat()).SerializeToString()
    decoded = deserialize_tokenize(data)
    assert isinstance(decoded, UndecodableRequest)
    assert decoded.field == "input"


def test_undecodable_bytes_are_refused_naming_the_request() -> None:
    with pytest.raises(InvalidRequestError) as caught:
        decode_generate(UndecodableRequest("request", "not a valid phasescope.v1.GenerateRequest"), LIMITS)
    assert caught.value.field == "request"


def test_a_structured_output_with_no_kind_is_refused() -> None:
    field = "sampling.structured"
    with pytest.raises(InvalidRequestError) as caught:
        build_sampling(sampling(structured=pb.StructuredOutput()), prompt_tokens=10, limits=LIMITS)
    assert caught.value.field == field
    assert str(caught.value).startswith(field + ":")


def test_the_generation_surface_reaches_the_engine_as_asked() -> None:
    asked = sampling(
        max_tokens=8, min_tokens=2, logit_bias={7: -100.0, 3: 5.0}, include_stop_str_in_output=True,
        skip_special_tokens=False, structured=pb.StructuredOutput(json_schema='{"type": "object"}'),
    )  # fmt: skip
    spec = build_sampling(asked, prompt_tokens=10, limits=LIMITS)
    assert (spec.min_tokens, spec.logit_bias) == (2, ((3, 5.0), (7, -100.0)))
    assert spec.include_stop_str_in_output
    assert not spec.skip_special_tokens
    assert spec.spaces_between_special_tokens  # unset: true
    assert spec.structured == StructuredOutput(
        "json_schema", value='{"type": "object"}', field="sampling.structured.json_schema"
    )
    choice = build_sampling(
        sampling(max_tokens=8, structured=pb.StructuredOutput(choice=pb.Choice(choices=["yes", "no"]))),
        prompt_tokens=10, limits=LIMITS,
    )  # fmt: skip
    assert choice.structured == StructuredOutput(
        "choice", choices=("yes", "no"), field="sampling.structured.choice.choices"
    )
    banned = build_sampling(sampling(max_tokens=8, bad_words=["Paris", "Lyon"]), prompt_tokens=10, limits=LIMITS)
    assert banned.bad_words == ("Paris", "Lyon")
    plain = build_sampling(sampling(max_tokens=8), prompt_tokens=10, limits=LIMITS)
    assert plain.structured is None
    assert plain.skip_special_tokens


def test_token_ids_only_turns_detokenisation_off_and_refuses_stop_strings() -> None:
    assert build_sampling(sampling(max_tokens=4), prompt_tokens=10, limits=LIMITS).detokenize
    spec = build_sampling(sampling(max_tokens=4, stop_token_ids=[5]), prompt_tokens=10, limits=LIMITS,
                          token_ids_only=True)  # fmt: skip
    assert not spec.detokenize
    assert spec.stop_token_ids == (5,)
    with pytest.raises(InvalidRequestError) as caught:
        build_sampling(sampling(max_tokens=4, stop=["."]), prompt_tokens=10, limits=LIMITS, token_ids_only=True)
    assert caught.value.field == "token_ids_only"


def test_a_stream_interval_is_passed_on_and_0_leaves_the_servers() -> None:
    assert build_sampling(sampling(max_tokens=4), prompt_tokens=10, limits=LIMITS).stream_interval is None
    spec = build_sampling(sampling(max_tokens=4), prompt_tokens=10, limits=LIMITS, stream_interval=8)
    assert spec.stream_interval == 8


def test_unset_sampling_takes_defaults_and_fills_the_context() -> None:
    spec = build_sampling(pb.SamplingParams(), prompt_tokens=10, limits=LIMITS)
    assert spec.max_tokens == 90
    assert spec.temperature is None
    assert spec.top_p is None
    assert spec.seed is None


def test_explicit_zero_temperature_is_kept() -> None:
    # proto3 `optional` tells "unset" from 0: greedy must not fall back to the default.
    spec = build_sampling(sampling(temperature=0.0, top_k=-1, max_tokens=90, seed=7), prompt_tokens=10, limits=LIMITS)
    assert spec.temperature == 0.0
    assert spec.top_k == -1
    assert spec.max_tokens == 90
    assert spec.seed == 7
