"""The sampling values phasescope.v1 sends smg's Rust server (`sampling_message`), read back as vLLM's engine
protocol reads them (`sampling_ask`): the same request, whichever way it crosses."""

from __future__ import annotations

import dataclasses

import pytest

from phasescope.engine.request import ModelLimits, SamplingSpec, StructuredOutput
from phasescope.errors import InvalidRequestError
from phasescope.serve.engine_protocol.requests import PREFIX, sampling_ask, sampling_message
from phasescope.serve.validation import build_sampling

LIMITS = ModelLimits(max_model_len=2048, vocab_size=49152, max_chars_per_token=16)

# Values a float32 holds exactly: the protocol's sampling floats are 32-bit.
EVERYTHING = SamplingSpec(
    max_tokens=7, temperature=0.0, top_p=0.875, top_k=40, min_p=0.0625, seed=1234, stop=("\n\n", "END"),
    stop_token_ids=(2, 7), presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.25, ignore_eos=True,
    min_tokens=3, logit_bias=((17, -100.0), (5, 2.5)), include_stop_str_in_output=True,
    skip_special_tokens=False, spaces_between_special_tokens=False, logprobs=3, prompt_logprobs=0,
)  # fmt: skip
SPECS = [
    SamplingSpec(max_tokens=16),
    EVERYTHING,
    SamplingSpec(max_tokens=5, temperature=0.75, n=3, seed=-4),
    SamplingSpec(max_tokens=5, structured=StructuredOutput("json_schema", value='{"type": "object"}')),
    SamplingSpec(max_tokens=5, structured=StructuredOutput("json_object")),
    SamplingSpec(max_tokens=5, structured=StructuredOutput("regex", value="[a-z]+")),
    SamplingSpec(max_tokens=5, structured=StructuredOutput("choice", choices=("yes", "no"))),
]


@pytest.mark.parametrize("spec", SPECS, ids=range(len(SPECS)))
def test_a_spec_sent_over_the_engine_protocol_reads_back_as_itself(spec: SamplingSpec) -> None:
    ask = sampling_ask(sampling_message(spec))
    again = build_sampling(ask, PREFIX, prompt_tokens=10, limits=LIMITS)
    # The structured output's field is the protocol's own name for it, which a refusal names.
    if spec.structured is not None:
        assert again.structured is not None
        again = dataclasses.replace(again, structured=dataclasses.replace(again.structured, field=""))
    # A map on the wire: the biases in any order.
    assert dataclasses.replace(again, logit_bias=tuple(sorted(again.logit_bias))) == dataclasses.replace(
        spec, logit_bias=tuple(sorted(spec.logit_bias))
    )


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (SamplingSpec(max_tokens=5, bad_words=("fox",)), "sampling.bad_words"),
        (SamplingSpec(max_tokens=5, seed=2**40), "sampling.seed"),
    ],
)
def test_what_the_engine_protocol_cannot_carry_is_refused_by_the_field_asked(spec: SamplingSpec, field: str) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        sampling_message(spec)
    assert refused.value.field == field
