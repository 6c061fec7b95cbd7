"""Speculative decoding served on the real engine: the model drafting for itself (the exact upper bound:
every drafted token is accepted and the text is the text without speculation), and n-gram lookup."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb

from phasescope.client.client import Client, build_request
from support.engine_protocol import open_engine_stub
from support.servers import ServerProcess

K = 3
CHAT = [("user", "Name three colours of the rainbow.")]
# A prompt that repeats itself: n-gram lookup finds the continuation in it.
REPEATING = " ".join(["one two three four five six seven eight"] * 12)


@pytest.fixture(scope="module")
def drafting_server(start_server: Callable[..., ServerProcess], default_model: Path) -> ServerProcess:
    config = {"method": "draft_model", "model": str(default_model), "num_speculative_tokens": K}
    return start_server("--speculative-config", json.dumps(config))


def engine_complete(server: ServerProcess, ids: list[int], max_tokens: int) -> Any:
    with open_engine_stub(server.address) as stub:
        request = vllm_pb.GenerateRequest(
            request_id="spec", tokenized=vllm_pb.TokenizedInput(input_ids=ids), stream=False,
            sampling_params=vllm_pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        )  # fmt: skip
        return [r.complete for r in stub.Generate(request, timeout=120) if r.HasField("complete")][-1]


def test_a_model_drafting_for_itself_answers_as_without_speculation_with_every_draft_accepted(
    drafting_server: ServerProcess, client: Client
) -> None:
    request = build_request(chat=CHAT, temperature=0.0, max_tokens=32, ignore_eos=True)
    plain = client.generate(request)
    with drafting_server.client() as drafting:
        speculative = drafting.generate(request)
    assert speculative.text == plain.text
    timings = speculative.timings
    # 32 tokens: the first comes from prefill, and each verify step of the other 31 drafts k tokens.
    assert timings.speculative_drafted_tokens >= K
    assert timings.speculative_accepted_tokens == timings.speculative_drafted_tokens
    assert (plain.timings.speculative_drafted_tokens, plain.timings.speculative_accepted_tokens) == (0, 0)
    # The stages add up as without speculation, and decode's rate counts emitted tokens, not positions verified.
    engine_time = timings.queue_seconds + timings.prefill_seconds + timings.decode_seconds
    assert timings.e2e_seconds >= engine_time
    assert timings.e2e_seconds - engine_time < 0.5 * timings.e2e_seconds
    assert speculative.usage.completion_tokens == 32
    assert timings.decode_tokens_per_second == pytest.approx(31 / timings.decode_seconds, rel=1e-6)
    assert timings.mean_inter_token_seconds == pytest.approx(timings.decode_seconds / 31, rel=1e-6)


def test_the_engine_protocol_reports_drafted_and_accepted_tokens_as_vllms_worker_does(
    drafting_server: ServerProcess,
) -> None:
    complete = engine_complete(drafting_server, [1, 504, 3458, 314, 260], max_tokens=16)
    assert complete.completion_tokens == 16
    assert complete.spec_draft_tokens >= K
    assert complete.spec_accepted_tokens == complete.spec_draft_tokens


def test_model_info_names_the_drafter(drafting_server: ServerProcess, default_model: Path) -> None:
    with drafting_server.client() as drafting:
        info = drafting.model_info()
    assert (info.speculative_method, info.speculative_tokens) == ("draft_model", K)
    assert info.speculative_draft_model == str(default_model)


def test_n_gram_drafts_accept_more_of_a_repeating_prompt_and_never_more_than_drafted(
    start_server: Callable[..., ServerProcess],
) -> None:
    config = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    server = start_server("--speculative-config", json.dumps(config))  # stopped with the module (conftest.Servers)
    with server.client() as ngram:
        repeating = ngram.generate(build_request(prompt=REPEATING, temperature=0.0, max_tokens=48)).timings
        varied = ngram.generate(
            build_request(chat=[("user", "Write a short poem about a lighthouse.")], temperature=0.0, max_tokens=48)
        ).timings
    for timings in (repeating, varied):
        assert timings.speculative_accepted_tokens <= timings.speculative_drafted_tokens
    assert repeating.speculative_drafted_tokens > 0
    rate = repeating.speculative_accepted_tokens / repeating.speculative_drafted_tokens
    varied_rate = varied.speculative_accepted_tokens / max(1, varied.speculative_drafted_tokens)
    assert rate > varied_rate


SERIES = (
    "phasescope_speculative_drafted_tokens_total",
    "vllm:spec_decode_num_draft_tokens_total",
    "phasescope_speculative_accepted_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
    "phasescope_speculative_drafts_total",
    "vllm:spec_decode_num_drafts_total",
    "vllm:generation_tokens_total",
)


def test_phasescopes_drafted_accepted_and_emitted_counts_equal_vllms_own_series(drafting_server: ServerProcess) -> None:
    def decode(name: str) -> float:
        return drafting_server.sample_sum(name, phase="decode")

    before = {name: drafting_server.sample_sum(name) for name in SERIES}
    emitted_before, verified_before = decode("phasescope_tokens_total"), decode("phasescope_engine_step_tokens_total")
    with drafting_server.client() as drafting:
        for prompt in ("Count from one to twenty.", "Tell me about the sea."):
            drafting.generate(build_request(prompt=prompt, temperature=0.0, max_tokens=24, ignore_eos=True))
    # vLLM counts a verify step before the answer leaves; phasescope's series get the last one a moment after it
    # (its report comes from the engine core through the hub): read once they agree, or after 10 s.
    deadline = time.monotonic() + 10
    while True:
        delta = {name: drafting_server.sample_sum(name) - before[name] for name in SERIES}
        if [delta[name] for name in SERIES[:6:2]] == [delta[name] for name in SERIES[1:6:2]]:
            break
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    drafted, accepted, drafts = (delta[name] for name in SERIES[:6:2])
    assert drafted > 0
    assert (drafted, accepted, drafts) == tuple(delta[name] for name in SERIES[1:6:2])
    assert accepted == drafted  # the model drafting for itself: every draft is accepted
    # Emitted tokens are the output, as vLLM counts it: 2 requests × 24.
    assert decode("phasescope_tokens_total") - emitted_before == delta["vllm:generation_tokens_total"] == 48
    # The verify steps' positions are counted apart: each draft's k tokens and one of its own.
    verified = decode("phasescope_engine_step_tokens_total") - verified_before
    assert verified >= drafted + drafts


def test_verify_steps_are_decode_and_the_drafters_cost_is_seen(drafting_server: ServerProcess) -> None:
    def steps(kind: str) -> float:
        return drafting_server.sample_sum("phasescope_engine_steps_total", kind=kind)

    before = {kind: steps(kind) for kind in ("prefill", "decode", "mixed")}
    drafts_before = drafting_server.sample_sum("phasescope_speculative_drafts_total")
    with drafting_server.client() as drafting:
        drafting.generate(build_request(prompt="Count from one to twenty.", temperature=0.0, max_tokens=24))
    delta = {kind: steps(kind) - before[kind] for kind in before}
    drafts = drafting_server.sample_sum("phasescope_speculative_drafts_total") - drafts_before
    # One request: its prompt is one prefill step; every verify step (k + 1 positions) is a decode step.
    assert delta["prefill"] == 1
    assert delta["decode"] + delta["mixed"] >= drafts > 0

    def gauge(name: str) -> float:
        return drafting_server.sample_sum(name)

    # The model drafting for itself, memory-bound on this CPU: its k passes read the weights k times beside the
    # verify step's one read, and do k of the k + 1 positions' FLOPs again.
    assert 0.6 < gauge("phasescope_speculative_drafter_time_ratio") < 0.85
    assert gauge("phasescope_speculative_useful_flops_ratio") == pytest.approx((K + 1) / (2 * K + 1), rel=0.05)
    # Every draft accepted, and yet no gain: each accepted token cost the drafter a weight read.
    assert gauge("phasescope_speculative_gain_ratio") == pytest.approx(1.0, rel=0.15)
    assert gauge("phasescope_speculative_acceptance_ratio") == pytest.approx(1.0, rel=1e-9)
    # A ratio of the window's prorated drafts and accepted tokens: exact up to float rounding.
    assert gauge("phasescope_speculative_mean_acceptance_length") == pytest.approx(K + 1, rel=1e-9)
