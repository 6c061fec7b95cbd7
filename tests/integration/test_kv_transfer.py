"""A worker with a KV connector, on the real engine: vLLM's ExampleConnector (kv_both, a local folder for its
store) behind --kv-transfer-config. GetServerInfo says which connector and role the worker has, a long prompt
sent again is loaded from the store instead of computed (vLLM's own count of transferred tokens grows) and
answers the same, and kv_transfer_params reach the engine on vLLM's engine protocol.

One server for the module, with a step budget of STEP_TOKENS: the long prompt is prefilled in one step, a prompt
over twice as long in three. vLLM's ExampleConnector alone kills the engine when a prompt shorter than one KV
block (128 tokens on a CPU) is seen twice (its lookup answers a negative match); phasescope's wrapper around
every connector refuses matches below one block, and a test here sends such prompts again and again.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb

from phasescope.client.client import build_request
from support.engine_protocol import open_engine_stub
from support.servers import ServerProcess

BLOCK_TOKENS = 128
"""vLLM's KV block on a CPU: the ExampleConnector stores and loads whole blocks of it."""
EXTERNAL = "vllm:prompt_tokens_by_source_total"
STEP_TOKENS = 768
"""The server's step budget (--max-num-batched-tokens): above LONG_PROMPT's 647 tokens, below half of
SPLIT_PROMPT's."""
# Distinct sentences, so nothing but the store can supply the prompt's KV once the prefix cache is flushed.
LONG_PROMPT = " ".join(
    f"Note {index}: the {colour} house on street {index} has {index % 7 + 2} windows and a {tree} tree."
    for index, (colour, tree) in enumerate(
        zip(
            ["red", "blue", "green", "white", "yellow"] * 6,
            ["oak", "pine", "maple", "birch", "elm", "ash"] * 5,
            strict=True,
        )
    )
)
LONG_PROMPT += " Which street has the most windows?"
SPLIT_PROMPT = " ".join(f"Part {part}. {LONG_PROMPT}" for part in range(3))


@pytest.fixture(scope="module")
def pd_server(
    start_server: Callable[..., ServerProcess], tmp_path_factory: pytest.TempPathFactory
) -> tuple[ServerProcess, Path]:
    store = tmp_path_factory.mktemp("kv-store")
    config = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(store)},
    }
    return start_server("--kv-transfer-config", json.dumps(config), "--max-num-batched-tokens", str(STEP_TOKENS)), store


def complete(server: ServerProcess, request_id: str, **fields: Any) -> Any:
    """A greedy unary Generate on vLLM's engine protocol: its `GenerateComplete`."""
    with open_engine_stub(server.address) as stub:
        request = vllm_pb.GenerateRequest(
            request_id=request_id, text=LONG_PROMPT, stream=False,
            sampling_params=vllm_pb.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), **fields,
        )  # fmt: skip
        (answer,) = [r.complete for r in stub.Generate(request, timeout=180) if r.HasField("complete")]
        return answer


def external_tokens(server: ServerProcess) -> float:
    return server.sample_sum(EXTERNAL, source="external_kv_transfer")


def test_a_connector_worker_says_its_connector_and_role_and_a_prompt_seen_again_is_loaded_through_it(
    pd_server: tuple[ServerProcess, Path],
) -> None:
    server, store = pd_server
    with open_engine_stub(server.address) as stub:
        info = stub.GetServerInfo(vllm_pb.GetServerInfoRequest(), timeout=30)
    assert (info.kv_connector, info.kv_role) == ("ExampleConnector", "kv_both")
    assert info.kv_engine_id  # vLLM makes one up when the configuration names none
    with server.client() as client:
        model = client.model_info()
    assert (model.kv_connector, model.kv_role, model.kv_engine_id) == ("ExampleConnector", "kv_both", info.kv_engine_id)

    before = external_tokens(server)
    first = complete(server, "kv-first")
    assert first.prompt_tokens >= 2 * BLOCK_TOKENS + 2
    assert any(store.iterdir()), "the connector stored nothing"
    server.flush_prefix_cache()
    computed_before = server.sample_sum(EXTERNAL, source="local_compute")
    second = complete(server, "kv-second")

    # The ExampleConnector loads the prompt's whole blocks but the last token's: (prompt − 2) // 128 blocks.
    loaded = (second.prompt_tokens - 2) // BLOCK_TOKENS * BLOCK_TOKENS
    deadline = time.monotonic() + 10
    while external_tokens(server) - before < loaded and time.monotonic() < deadline:
        time.sleep(0.2)
    assert external_tokens(server) - before == loaded >= 2 * BLOCK_TOKENS
    # Only the rest was computed, and the answer counts the transferred tokens as cached, as vLLM's worker does.
    assert server.sample_sum(EXTERNAL, source="local_compute") - computed_before == second.prompt_tokens - loaded
    assert (first.cached_tokens, second.cached_tokens) == (0, loaded)
    assert list(second.output_ids) == list(first.output_ids)
    assert len(first.output_ids) == 16


def test_kv_transfer_params_pass_through_to_the_connector_without_error(pd_server: tuple[ServerProcess, Path]) -> None:
    server, _ = pd_server
    plain = complete(server, "kv-plain")
    as_json = complete(server, "kv-json", kv_transfer_params_json=json.dumps({"do_remote_prefill": False, "x": [1]}))
    typed = complete(
        server, "kv-typed", kv_transfer_params=vllm_pb.KvTransferParams(remote_host="127.0.0.1", remote_port=5600)
    )
    for answer in (as_json, typed):
        assert answer.finish_reason == "length"
        assert list(answer.output_ids) == list(plain.output_ids)
        # The ExampleConnector answers nothing for the next worker.
        assert not answer.HasField("kv_transfer_params_json")
    # Malformed parameters are the caller's fault, and the worker keeps serving.
    with open_engine_stub(server.address) as stub:
        bad = vllm_pb.GenerateRequest(request_id="kv-bad", text=LONG_PROMPT, kv_transfer_params_json="[1]")
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(bad, timeout=60))
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert (caught.value.details() or "").startswith("kv_transfer_params_json: ")
    assert server.health() == "SERVING"


def test_prompts_shorter_than_one_block_seen_again_do_not_take_the_worker_down(
    pd_server: tuple[ServerProcess, Path],
) -> None:
    server, _ = pd_server
    with server.client() as client:
        for prompt in ("Hi", "Hi", "A", "A", "Hello there", "Hello there"):
            answer = client.generate(build_request(prompt=prompt, temperature=0.0, max_tokens=4, ignore_eos=True))
            assert answer.usage.completion_tokens == 4
    # Each was computed, never "loaded" from a match shorter than a block; the worker still serves.
    assert server.health() == "SERVING"
    assert complete(server, "kv-after-short").finish_reason == "length"


def test_each_requests_kv_transfer_is_a_stage_inside_its_prefill_with_the_tokens_and_bytes_moved(
    pd_server: tuple[ServerProcess, Path],
) -> None:
    """The ExampleConnector saves a new prompt's KV in the steps that compute it and loads a stored one inside the
    step that first computes the request: both are the kv_transfer stage, inside prefill, and the stages that tile
    the request still add up to its end-to-end time."""
    server, _ = pd_server
    prompt = "Count the colours. " + LONG_PROMPT  # not stored yet: the store matches a prompt from its start
    request = build_request(prompt=prompt, temperature=0.0, max_tokens=8, ignore_eos=True)
    with server.client() as client:
        bytes_per_token = client.model_info().kv_cache_bytes_per_token
        loaded_before = server.sample_sum("phasescope_kv_transfer_tokens_total", direction="loaded")
        external_before = external_tokens(server)
        bytes_before = server.sample_sum("phasescope_kv_transfer_bytes_total")
        server.flush_prefix_cache()  # the earlier tests' prompts share its first blocks
        first = client.generate(request)
        server.flush_prefix_cache()
        second = client.generate(request)
    prompt_tokens = first.usage.prompt_tokens
    saved, loaded = first.timings, second.timings
    # First seen: computed and saved, nothing loaded.
    assert (saved.kv_loaded_tokens, saved.kv_saved_tokens) == (0, prompt_tokens)
    # Seen again: the stored whole blocks loaded (vLLM's own count agrees), the rest computed, and saved in turn.
    assert loaded.kv_loaded_tokens == (prompt_tokens - 2) // BLOCK_TOKENS * BLOCK_TOKENS >= 2 * BLOCK_TOKENS
    assert second.usage.cached_prompt_tokens == loaded.kv_loaded_tokens
    assert loaded.kv_saved_tokens in (0, prompt_tokens - loaded.kv_loaded_tokens)
    for timings in (saved, loaded):
        assert 0.0 < timings.kv_transfer_seconds <= timings.prefill_seconds
        assert timings.kv_transfer_bytes == (timings.kv_loaded_tokens + timings.kv_saved_tokens) * bytes_per_token
        tiled = sum(
            getattr(timings, f"{stage}_seconds") for stage in ("frontend", "intake", "queue", "prefill", "decode")
        )
        assert tiled == pytest.approx(timings.e2e_seconds, abs=1e-6)
    assert list(second.token_ids) == list(first.token_ids)
    # The same in the series, beside vLLM's count of the tokens that came through the connector.
    deadline = time.monotonic() + 10
    while external_tokens(server) - external_before < loaded.kv_loaded_tokens and time.monotonic() < deadline:
        time.sleep(0.2)
    assert (
        server.sample_sum("phasescope_kv_transfer_tokens_total", direction="loaded") - loaded_before
        == external_tokens(server) - external_before
        == loaded.kv_loaded_tokens
    )
    assert server.sample_sum("phasescope_kv_transfer_bytes_total") - bytes_before == pytest.approx(
        saved.kv_transfer_bytes + loaded.kv_transfer_bytes
    )
    assert server.sample_sum("phasescope_request_phase_seconds_count", phase="kv_transfer") >= 2


def test_a_stored_entry_shorter_than_its_match_is_recomputed_and_the_worker_keeps_serving(
    pd_server: tuple[ServerProcess, Path],
) -> None:
    """vLLM's ExampleConnector stores only a prompt's first chunk when the prompt is prefilled in several steps,
    under the whole prompt's name; loading it again fails ("shape mismatch"), which alone ends the engine. Behind
    phasescope's connector the failed load's blocks are recomputed: the same answer, nothing counted as loaded."""
    server, _ = pd_server
    request = build_request(prompt=SPLIT_PROMPT, temperature=0.0, max_tokens=4, ignore_eos=True)
    with server.client() as client:
        first = client.generate(request)
        assert first.usage.prompt_tokens > 2 * STEP_TOKENS  # prefilled in three steps
        server.flush_prefix_cache()
        second = client.generate(request)
    assert list(second.token_ids) == list(first.token_ids)
    assert second.timings.kv_loaded_tokens == 0
    assert server.health() == "SERVING"
