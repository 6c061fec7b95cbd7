"""The request rules both protocols share (`phasescope.serve.validation`). The sampling rules are reached
through a phasescope.v1 message, decoded as its handler decodes it, so each refusal names the field as a client
spells it; phasescope.v1's own decoding is tested in test_v1_requests.py."""

import math

import pytest

from phasescope.engine.request import ModelLimits, SamplingSpec
from phasescope.errors import InvalidRequestError
from phasescope.serve import validation
from phasescope.serve.v1_requests import decode_generate
from phasescope.serve.validation import (
    MAX_STOP_STRINGS,
    check_prompt_chars,
    check_prompt_length,
    truncate_prompt,
)
from phasescope.v1 import inference_pb2 as pb

# At most 99 prompt tokens of at most 8 characters each: 792 characters.
LIMITS = ModelLimits(max_model_len=100, vocab_size=1000, max_chars_per_token=8)


def sampling(**values: object) -> pb.SamplingParams:
    return pb.SamplingParams(**values)  # type: ignore[arg-type]


def build_sampling(message: pb.SamplingParams, prompt_tokens: int, limits: ModelLimits) -> SamplingSpec:
    """phasescope.v1's sampling message as the request path validates it (decoded, then built)."""
    ask = decode_generate(pb.GenerateRequest(prompt="x", sampling=message), limits)
    return validation.build_sampling(ask.sampling, ask.sampling_prefix, prompt_tokens, limits)


def test_text_is_refused_unread_only_when_no_tokenisation_could_fit_it() -> None:
    check_prompt_chars(792, LIMITS, "prompt")  # might be 99 tokens: only the tokenizer can tell
    with pytest.raises(InvalidRequestError) as caught:
        check_prompt_chars(10_000, LIMITS, "prompt")
    assert str(caught.value) == (
        "prompt: 10000 characters cannot fit in the context window of 100 tokens "
        "(no token of this model spans more than 8 characters, so at most 792 fit)"
    )
    with pytest.raises(InvalidRequestError) as caught:
        check_prompt_chars(793, LIMITS, "chat")
    assert caught.value.field == "chat"


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"max_tokens": 0}, "sampling.max_tokens"),
        ({"max_tokens": 91}, "sampling.max_tokens"),  # 10 prompt tokens + 91 > 100
        ({"temperature": -0.1}, "sampling.temperature"),
        ({"temperature": math.nan}, "sampling.temperature"),
        ({"temperature": math.inf}, "sampling.temperature"),
        ({"top_p": 0.0}, "sampling.top_p"),
        ({"top_p": 1.5}, "sampling.top_p"),
        ({"top_k": -2}, "sampling.top_k"),
        ({"min_p": 1.1}, "sampling.min_p"),
        ({"presence_penalty": 2.5}, "sampling.presence_penalty"),
        ({"frequency_penalty": -3.0}, "sampling.frequency_penalty"),
        ({"repetition_penalty": 0.0}, "sampling.repetition_penalty"),
        ({"stop": [""]}, "sampling.stop[0]"),
        ({"stop": ["x" * 2000]}, "sampling.stop[0]"),
        ({"stop": ["s"] * (MAX_STOP_STRINGS + 1)}, "sampling.stop"),
        ({"stop_token_ids": [5, 1000]}, "sampling.stop_token_ids[1]"),
        ({"max_tokens": 4, "min_tokens": 5}, "sampling.min_tokens"),
        ({"bad_words": ["ok", " "]}, "sampling.bad_words[1]"),
        ({"bad_words": ["w"] * (MAX_STOP_STRINGS + 1)}, "sampling.bad_words"),
        ({"logit_bias": {1000: 1.0}}, "sampling.logit_bias"),
        ({"logit_bias": {7: 101.0}}, "sampling.logit_bias[7]"),
        ({"logit_bias": {7: math.nan}}, "sampling.logit_bias[7]"),
        ({"structured": pb.StructuredOutput(json_schema="{not json")}, "sampling.structured.json_schema"),
        ({"structured": pb.StructuredOutput(structural_tag="")}, "sampling.structured.structural_tag"),
        ({"structured": pb.StructuredOutput(regex="")}, "sampling.structured.regex"),
        ({"structured": pb.StructuredOutput(grammar="")}, "sampling.structured.grammar"),
        ({"structured": pb.StructuredOutput(choice=pb.Choice())}, "sampling.structured.choice.choices"),
        (
            {"structured": pb.StructuredOutput(choice=pb.Choice(choices=["a", ""]))},
            "sampling.structured.choice.choices[1]",
        ),
    ],
)
def test_bad_sampling_names_its_field(values: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        build_sampling(sampling(**values), prompt_tokens=10, limits=LIMITS)
    assert caught.value.field == field
    assert str(caught.value).startswith(field + ":")


@pytest.mark.parametrize("prompt_tokens", [0, 100, 150])
def test_prompt_without_room_for_output_is_refused(prompt_tokens: int) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        check_prompt_length(prompt_tokens, LIMITS, "prompt")
    assert caught.value.field == "prompt"


def test_prompt_one_token_short_of_the_window_is_accepted() -> None:
    check_prompt_length(99, LIMITS, "prompt")


def test_truncation_keeps_the_prompts_last_tokens() -> None:
    prompt = list(range(1, 11))
    assert truncate_prompt(prompt, None, LIMITS, "f") == prompt
    assert truncate_prompt(prompt, 3, LIMITS, "f") == [8, 9, 10]
    assert truncate_prompt(prompt, 30, LIMITS, "f") == prompt
    long = list(range(150))
    assert truncate_prompt(long, -1, LIMITS, "f") == long[-99:]  # room for one output token in 100
    for bad in (0, -2):
        with pytest.raises(InvalidRequestError) as caught:
            truncate_prompt(prompt, bad, LIMITS, "sampling.truncate_prompt_tokens")
        assert caught.value.field == "sampling.truncate_prompt_tokens"
