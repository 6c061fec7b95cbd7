"""LoRA adapters on the real engine: one tiny-model server with two adapters made on the spot (PEFT folders, no
download), one with B zero and one with B random, one adapter slot a step (--max-loras 1), and adapter updates
allowed.

A zero-B adapter adds nothing, so it answers exactly as the base model; the random one answers otherwise. Both
protocols select an adapter (phasescope.v1's `adapter` field, the engine protocol's metadata key); one not served
is NOT_FOUND naming where it came from, a folder that is no adapter for this model is refused naming `path`, and the
server keeps serving through all of it.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb

from phasescope.bench.adapters import write_lora_adapter
from phasescope.bench.tiny_model import ensure_tiny_model
from phasescope.client.client import build_request
from phasescope.telemetry.exposition import Samples, sum_samples
from phasescope.telemetry.model.adapter import projection_sizes
from support.engine_protocol import open_engine_stub
from support.servers import ServerProcess

pytestmark = pytest.mark.integration

RANK = 8
PROMPT = [100 + 7 * i for i in range(24)]


def tiny_config() -> dict[str, Any]:
    config: dict[str, Any] = json.loads((ensure_tiny_model() / "config.json").read_text())
    return config


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("adapters")
    config = tiny_config()
    return {
        "zero": write_lora_adapter(folder / "zero", config, rank=RANK, zero_b=True, seed=1),
        "noise": write_lora_adapter(folder / "noise", config, rank=RANK, seed=2),
        # For LoadAdapter: a good one, one of too high a rank, one for another base (the default model's shape).
        "late": write_lora_adapter(folder / "late", config, rank=RANK, seed=3),
        "too-big": write_lora_adapter(folder / "too-big", config, rank=16, seed=4),
        "foreign": write_lora_adapter(folder / "foreign", {**config, "hidden_size": 576, "head_dim": 64}, seed=5),
    }


@pytest.fixture(scope="module")
def lora_server(start_server: Callable[..., ServerProcess], adapters: dict[str, Path]) -> ServerProcess:
    return start_server(
        "--model", str(ensure_tiny_model()), "--lora-modules", f"zero={adapters['zero']}",
        f"noise={adapters['noise']}", "--max-loras", "1", "--max-cpu-loras", "4", "--max-lora-rank", str(RANK),
        "--allow-adapter-updates", "--accelerator-cost-per-hour", "3.6",
    )  # fmt: skip


def greedy(server: ServerProcess, adapter: str = "") -> list[int]:
    with server.client() as client:
        answer = client.generate(
            build_request(token_ids=PROMPT, max_tokens=16, temperature=0.0, ignore_eos=True, adapter=adapter)
        )
    return list(answer.token_ids)


def test_a_zero_adapter_answers_as_the_base_model_and_a_random_one_otherwise(lora_server: ServerProcess) -> None:
    base = greedy(lora_server)
    assert len(base) == 16
    assert greedy(lora_server, "zero") == base
    assert greedy(lora_server, "noise") != base
    # And on vLLM's engine protocol, selected by the metadata key.
    with open_engine_stub(lora_server.address) as stub:
        request = vllm_pb.GenerateRequest(
            request_id="lora-engine",
            tokenized=vllm_pb.TokenizedInput(input_ids=PROMPT),
            sampling_params=vllm_pb.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
        )
        responses = list(stub.Generate(request, metadata=(("phasescope-adapter", "noise"),), timeout=60))
    assert list(responses[-1].complete.output_ids) == greedy(lora_server, "noise")


def test_model_info_lists_each_adapter_with_its_rank_targets_and_bytes(lora_server: ServerProcess) -> None:
    with lora_server.client() as client:
        info = client.model_info()
    assert (info.max_loras, info.max_lora_rank) == (1, RANK)
    served = {adapter.name: adapter for adapter in info.adapters}
    assert set(served) == {"zero", "noise"}
    sizes = projection_sizes(tiny_config())
    layers = tiny_config()["num_hidden_layers"]
    # A (r × in) and B (out × r) of q_proj and v_proj in every layer, float32.
    elements = layers * sum(RANK * (sizes[m][0] + sizes[m][1]) for m in ("q_proj", "v_proj"))
    for adapter in served.values():
        assert (adapter.rank, list(adapter.target_modules), adapter.dtype) == (RANK, ["q_proj", "v_proj"], "F32")
        assert adapter.bytes == 4 * elements
        assert adapter.flops_per_token == 2 * elements


def test_an_adapter_not_served_is_not_found_on_both_protocols_and_the_server_keeps_serving(
    lora_server: ServerProcess,
) -> None:
    with lora_server.client() as client, pytest.raises(grpc.RpcError) as caught:
        client.generate(build_request(token_ids=PROMPT, max_tokens=2, adapter="missing"))
    assert caught.value.code() is grpc.StatusCode.NOT_FOUND
    assert caught.value.details() == "adapter: no adapter named 'missing' is served (served: zero, noise)"
    request = vllm_pb.GenerateRequest(
        request_id="lora-missing",
        tokenized=vllm_pb.TokenizedInput(input_ids=PROMPT),
        sampling_params=vllm_pb.SamplingParams(max_tokens=2),
    )
    with open_engine_stub(lora_server.address) as stub, pytest.raises(grpc.RpcError) as caught:
        list(stub.Generate(request, metadata=(("phasescope-adapter", "missing"),), timeout=60))
    assert caught.value.code() is grpc.StatusCode.NOT_FOUND
    assert lora_server.health() == "SERVING"
    assert len(greedy(lora_server, "zero")) == 16


def test_loading_checks_the_folder_against_the_model_and_an_unloaded_adapter_is_gone(
    lora_server: ServerProcess, adapters: dict[str, Path], tmp_path: Path
) -> None:
    with lora_server.client() as client:
        refused = {
            str(tmp_path): "is not a LoRA adapter: it has no adapter_config.json",
            str(adapters["too-big"]): f"rank 16 is above the engine's --max-lora-rank {RANK}",
            str(adapters["foreign"]): "an adapter for another base model",
        }
        for path, message in refused.items():
            with pytest.raises(grpc.RpcError) as caught:
                client.load_adapter("late", path)
            assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert (caught.value.details() or "").startswith("path: ")
            assert message in (caught.value.details() or "")
        loaded = client.load_adapter("late", str(adapters["late"]))
        assert (loaded.name, loaded.rank) == ("late", RANK)
        assert len(greedy(lora_server, "late")) == 16
        client.unload_adapter("late")
        assert sorted(adapter.name for adapter in client.list_adapters()) == ["noise", "zero"]
        with pytest.raises(grpc.RpcError) as caught:
            client.generate(build_request(token_ids=PROMPT, max_tokens=2, adapter="late"))
        assert caught.value.code() is grpc.StatusCode.NOT_FOUND
    assert lora_server.health() == "SERVING"


def test_each_adapters_tokens_are_what_its_clients_received_and_add_up_to_the_total(
    lora_server: ServerProcess,
) -> None:
    def decoded() -> dict[str, float]:
        samples = lora_server.samples()
        labels = {"base", "zero", "noise"}
        by_adapter = {a: sum_samples(samples, "phasescope_tokens_total", phase="decode", adapter=a) for a in labels}
        return {**by_adapter, "all": sum_samples(samples, "phasescope_tokens_total", phase="decode")}

    lora_server.wait_engine_idle()
    before = decoded()
    received = {"base": 0, "zero": 0, "noise": 0}
    with lora_server.client() as client:
        for index, adapter in enumerate(["noise", "zero", "", "noise", "noise", "zero"]):
            answer = client.generate(
                build_request(token_ids=PROMPT, max_tokens=5 + index, ignore_eos=True, adapter=adapter, seed=index)
            )
            received[adapter or "base"] += answer.usage.completion_tokens
    lora_server.wait_engine_idle()
    after = decoded()
    assert {a: after[a] - before[a] for a in received} == received
    assert after["all"] - before["all"] == sum(received.values())


def test_with_one_adapter_slot_requests_for_two_adapters_wait_for_adapters_and_the_verdict_says_so(
    lora_server: ServerProcess,
) -> None:
    # Eight requests at once, alternating the two adapters: one adapter runs a step, so the other's requests wait
    # for its slot while the batch has room for all eight.
    lora_server.wait_engine_idle()
    scrapes: list[Samples] = []
    done = threading.Event()

    def scrape() -> None:
        while not done.is_set():
            scrapes.append(lora_server.samples())
            time.sleep(0.1)

    def ask(index: int) -> int:
        with lora_server.client() as client:
            request = build_request(
                token_ids=PROMPT, max_tokens=64, ignore_eos=True, adapter=("zero", "noise")[index % 2]
            )
            return client.generate(request).usage.completion_tokens

    watcher = threading.Thread(target=scrape)
    watcher.start()
    try:
        with ThreadPoolExecutor(max_workers=8) as pool:
            assert list(pool.map(ask, range(8))) == [64] * 8
        scrapes.append(lora_server.samples())
    finally:
        done.set()
        watcher.join()
    waiting = [sum_samples(s, "phasescope_engine_waiting_requests", reason="adapters") for s in scrapes]
    assert max(waiting) >= 1
    shares = [sum_samples(s, "phasescope_queue_wait_by_reason_ratio", reason="adapters") for s in scrapes]
    assert max(shares) >= 0.1
    verdicts = [sum_samples(s, "phasescope_bound", phase="decode", verdict="adapters") for s in scrapes]
    assert max(verdicts) == 1
    # Nothing waited for KV blocks or a batch slot: the adapter slot was the wall.
    assert max(sum_samples(s, "phasescope_engine_waiting_requests", reason="slot") for s in scrapes) == 0


def test_a_step_that_runs_an_adapter_reads_its_matrices_once_and_pays_its_flops_per_token(
    lora_server: ServerProcess,
) -> None:
    # One request alone, with the random adapter: its prefill step and each decode step run it once.
    with lora_server.client() as client:
        noise = next(adapter for adapter in client.model_info().adapters if adapter.name == "noise")

    def read() -> tuple[float, float, float]:
        samples = lora_server.samples()
        return (
            sum_samples(samples, "phasescope_adapter_read_bytes_total", adapter="noise"),
            sum_samples(samples, "phasescope_adapter_flops_total", adapter="noise"),
            sum_samples(samples, "phasescope_adapter_steps_total", adapter="noise"),
        )

    lora_server.wait_engine_idle()
    bytes_before, flops_before, steps_before = read()
    with lora_server.client() as client:
        answer = client.generate(build_request(token_ids=PROMPT, max_tokens=12, ignore_eos=True, adapter="noise"))
    # The last step's report reaches the series from the engine core a moment after the answer: read until it is
    # there, up to 10 s.
    deadline = time.monotonic() + 10
    while (after := read())[2] - steps_before < answer.usage.completion_tokens and time.monotonic() < deadline:
        time.sleep(0.05)
    bytes_after, flops_after, steps_after = after
    # The prompt in one step, then one step per further token.
    assert steps_after - steps_before == answer.usage.completion_tokens == 12
    assert bytes_after - bytes_before == pytest.approx(12 * noise.bytes)
    assert flops_after - flops_before == pytest.approx((len(PROMPT) + 12 - 1) * noise.flops_per_token)
    # Alone in its steps, the request's adapter is charged their whole time, at 3.6 an hour (0.001 a second).
    samples = lora_server.samples()
    busy = sum_samples(samples, "phasescope_adapter_busy_seconds_total", adapter="noise")
    assert busy > 0
    assert sum_samples(samples, "phasescope_adapter_cost_total", adapter="noise") == pytest.approx(busy * 0.001)
