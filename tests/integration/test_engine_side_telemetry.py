"""phasescope's physics behind front ends it does not run: smg's Rust request path (`--front-end rust`) and vLLM's
own OpenAI server (`--front-end external`), each engine core reporting its steps and requests to phasescope's hub.

Under 64 concurrent streams on the tiny model, the hub counts exactly what the engine did: the decode tokens the
clients received, the prompt tokens sent (no prefix cache), and each finished request's stages equal to vLLM's
own series where vLLM exports them.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import openai
import pytest

from phasescope.bench.harness import ManagedProcess, free_port
from phasescope.bench.targets import VllmEngineTarget
from phasescope.bench.tiny_model import ensure_tiny_model
from phasescope.bench.workload import BenchRequest, RequestRecord
from phasescope.client.client import Client
from phasescope.engine.vllm import TELEMETRY_SCHEDULER
from phasescope.telemetry.exposition import fetch_samples, sum_samples
from phasescope.v1 import inference_pb2 as pb
from support.servers import ServerProcess, assert_front_end_off_the_workers_cpus, engine_cpus

STREAMS = 64
OUTPUT_TOKENS = 24


def prompt(index: int) -> str:
    # Different from one another, so no prefix is shared whatever the cache does.
    return f"request {index}: the quick brown fox jumps over the lazy dog {index * 7919}"


def eventually(
    condition: Callable[[], bool],
    within_seconds: float = 15.0,
    what: str = "the hub never counted what the clients received",
) -> None:
    """The engine cores' reports reach the hub a moment after the clients' answers."""
    deadline = time.monotonic() + within_seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def assert_counts_what_the_engine_did(metrics_url: str, prompt_tokens: int, output_tokens: int) -> dict[str, float]:
    """The hub's series against what the clients sent and received; its request stages' sums, by stage."""

    def total(name: str, **labels: str) -> float:
        return sum_samples(fetch_samples(metrics_url), name, **labels)

    eventually(lambda: total("phasescope_requests_total") >= STREAMS)
    assert total("phasescope_requests_total", finish_reason="length", code="OK") == STREAMS
    assert total("phasescope_tokens_total", phase="decode") == output_tokens
    assert total("phasescope_tokens_total", phase="prefill") == prompt_tokens
    # The steps: every prompt token through prefill, every output token after each request's first through decode.
    assert total("phasescope_engine_step_tokens_total", phase="prefill") == prompt_tokens
    assert total("phasescope_engine_step_tokens_total", phase="decode") == output_tokens - STREAMS
    assert total("phasescope_inter_token_latency_seconds_count") == output_tokens - STREAMS
    assert total("phasescope_model_read_bytes_total", phase="decode") > 0
    # Watching cost the engine loop something, and dropped nothing.
    assert total("phasescope_engine_telemetry_dropped_reports_total") == 0
    assert total("phasescope_engine_telemetry_hook_seconds_total") > 0
    for stage in ("queue", "prefill", "decode"):
        assert total("phasescope_request_phase_seconds_count", phase=stage) == STREAMS
    # What only a front end knows is not made up.
    assert total("phasescope_request_phase_seconds_count", phase="frontend") == 0
    assert total("phasescope_time_to_first_token_seconds_count") == 0
    return {
        stage: total("phasescope_request_phase_seconds_sum", phase=stage) for stage in ("queue", "prefill", "decode")
    }


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    return ensure_tiny_model()


@dataclass
class Hub:
    server: ServerProcess
    endpoint: str
    """Where the engine cores publish (what vLLM's server is started with)."""


@pytest.fixture(scope="module")
def hub(start_server: Callable[..., ServerProcess]) -> Hub:
    """phasescope with no front end of its own: the hub on a TCP port, /metrics."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    server = start_server("--front-end", "external", "--telemetry-listen", endpoint, wait=False)
    server.wait_until(lambda: urllib.request.urlopen(server.metrics_url, timeout=2).status == 200, "the hub")
    return Hub(server, endpoint)


@pytest.fixture(scope="module")
def vllm_openai(hub: Hub, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """vLLM's own OpenAI server, its engine core running phasescope's scheduler and publishing to the hub."""
    port = free_port()
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model),
        "--served-model-name", "tiny", "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
        "--kv-cache-memory-bytes", str(2**30), "--no-enable-prefix-caching", "--max-num-seqs", str(STREAMS),
        "--scheduler-cls", TELEMETRY_SCHEDULER, "--enable-mfu-metrics",
        "--host", "127.0.0.1", "--port", str(port), "--disable-uvicorn-access-log",
    ]  # fmt: skip
    env = {"PHASESCOPE_TELEMETRY_ENDPOINT": hub.endpoint, "VLLM_LOGGING_LEVEL": "WARNING", **engine_cpus()}
    log = tmp_path_factory.mktemp("vllm-openai") / "server.log"
    with ManagedProcess(command, log, env=env) as server:
        base = f"http://127.0.0.1:{port}"
        server.wait_until(lambda: urllib.request.urlopen(f"{base}/health", timeout=2).status == 200, "vLLM")
        yield base


async def _complete_all(base: str) -> list[tuple[int, int]]:
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    try:

        async def one(index: int) -> tuple[int, int]:
            answer = await client.completions.create(
                model="tiny", prompt=prompt(index), max_tokens=OUTPUT_TOKENS, extra_body={"ignore_eos": True}
            )
            assert answer.usage is not None
            return answer.usage.prompt_tokens, answer.usage.completion_tokens

        return await asyncio.gather(*(one(index) for index in range(STREAMS)))
    finally:
        await client.close()


def test_behind_vllms_openai_server_the_hub_counts_exactly_what_the_engine_did(hub: Hub, vllm_openai: str) -> None:
    usage = asyncio.run(_complete_all(vllm_openai))
    prompt_tokens, output_tokens = sum(p for p, _ in usage), sum(c for _, c in usage)
    assert output_tokens == STREAMS * OUTPUT_TOKENS
    stages = assert_counts_what_the_engine_did(hub.server.metrics_url, prompt_tokens, output_tokens)
    # vLLM's own series (its front end's), from the same engine stamps: the same sums.
    vllm = fetch_samples(f"{vllm_openai}/metrics")
    for stage in ("queue", "prefill", "decode"):
        name = f"vllm:request_{stage}_time_seconds"
        assert sum_samples(vllm, f"{name}_count") == STREAMS
        assert stages[stage] == pytest.approx(sum_samples(vllm, f"{name}_sum"), rel=1e-9, abs=1e-9), stage
    assert sum_samples(vllm, "vllm:prompt_tokens_total") == prompt_tokens


def test_the_hub_learns_the_served_model_and_its_device_from_the_engine_core(hub: Hub, vllm_openai: str) -> None:
    # The engine core said what it is with its first message: the series carry vLLM's served name, and the
    # device figures are judged against the CPU's measured peaks.
    text = urllib.request.urlopen(hub.server.metrics_url, timeout=5).read().decode()
    assert 'phasescope_engine_busy_ratio{engine="0",model="tiny"}' in text
    assert "phasescope_hardware_peak_memory_bandwidth_bytes_per_second" in text


@dataclass
class RustServer:
    server: ServerProcess
    v1_address: str
    """Where phasescope.v1 is served beside smg's Rust server."""

    @property
    def address(self) -> str:
        return self.server.address

    @property
    def metrics_url(self) -> str:
        return self.server.metrics_url


@pytest.fixture(scope="module")
def rust_server(start_server: Callable[..., ServerProcess], tiny_model: Path) -> RustServer:
    v1_port = free_port()
    server = start_server(
        "--front-end", "rust", "--model", str(tiny_model), "--served-model-name", "tiny",
        "--max-concurrent-requests", str(STREAMS), "--v1-port", str(v1_port),
        # Its front end (smg's Rust server in it) kept off the engine worker's CPUs, which nothing else here may notice.
        "--pin-front-end",
    )  # fmt: skip
    v1 = Client(f"127.0.0.1:{v1_port}", timeout_seconds=60)
    try:
        server.wait_until(lambda: v1.health() == "SERVING", "phasescope.v1 beside the Rust server")
    finally:
        v1.close()
    return RustServer(server, f"127.0.0.1:{v1_port}")


def test_a_pinned_rust_front_end_leaves_the_engine_workers_cpus_to_them(rust_server: RustServer) -> None:
    assert_front_end_off_the_workers_cpus(rust_server.server)


def test_once_up_the_rust_front_end_keeps_its_start_up_heap_out_of_collections(rust_server: RustServer) -> None:
    # As the Python front end does once its engine is up: a full collection would otherwise walk vLLM's and torch's
    # start-up objects while the hub and phasescope.v1 wait.
    said = "start-up objects kept out of collections, the youngest generation collected every 3200 objects"
    eventually(lambda: said in rust_server.server.log_path.read_text(errors="replace"), what=said)


async def _stream_all(address: str, tokenizer: str) -> list[RequestRecord]:
    target = VllmEngineTarget(address, "rust", tokenizer)
    records = [RequestRecord(index=index, sent=time.perf_counter()) for index in range(STREAMS)]
    try:
        await asyncio.gather(
            *(
                target.stream(BenchRequest(index, prompt(index), OUTPUT_TOKENS), records[index])
                for index in range(STREAMS)
            )
        )
    finally:
        await target.close()
    return records


def test_behind_smgs_rust_request_path_the_hub_counts_exactly_what_the_engine_did(
    rust_server: RustServer, tiny_model: Path
) -> None:
    # The prefix cache off for the count: each prompt differs, and the cache is flushed first (the Rust server
    # serves vLLM's FlushCache as vLLM's worker does).
    rust_server.server.flush_prefix_cache()
    records = asyncio.run(_stream_all(rust_server.address, str(tiny_model)))
    assert all(record.output_tokens == OUTPUT_TOKENS for record in records)
    prompt_tokens = sum(record.prompt_tokens for record in records)
    assert_counts_what_the_engine_did(rust_server.metrics_url, prompt_tokens, STREAMS * OUTPUT_TOKENS)


def _phase_sums(metrics_url: str) -> dict[str, float]:
    samples = fetch_samples(metrics_url)
    sums = {
        stage: sum_samples(samples, "phasescope_request_phase_seconds_sum", phase=stage)
        for stage in ("queue", "prefill", "decode")
    }
    sums["requests"] = sum_samples(samples, "phasescope_requests_total")
    return sums


def test_phasescope_v1_beside_the_rust_server_answers_with_the_engines_own_stages(rust_server: RustServer) -> None:
    # One request alone: what its answer says of the engine's stages is what the hub counted for it (the same
    # engine stamps), and it is counted once, though it came through two front ends.
    rust_server.server.wait_engine_idle()
    before = _phase_sums(rust_server.metrics_url)
    with Client(rust_server.v1_address, timeout_seconds=60) as client:
        answer = client.generate(
            pb.GenerateRequest(
                prompt="the engine's own stages", sampling=pb.SamplingParams(max_tokens=12, ignore_eos=True)
            )
        )
    assert answer.usage.completion_tokens == len(answer.token_ids) == 12
    assert answer.text  # detokenised beside the Rust server, which returns token ids only
    eventually(lambda: _phase_sums(rust_server.metrics_url)["requests"] == before["requests"] + 1)
    after = _phase_sums(rust_server.metrics_url)
    timings = answer.timings
    for stage, seconds in (
        ("queue", timings.queue_seconds),
        ("prefill", timings.prefill_seconds),
        ("decode", timings.decode_seconds),
    ):
        assert seconds > 0, stage
        assert after[stage] - before[stage] == pytest.approx(seconds, rel=1e-6, abs=1e-9), stage
    # What only this front end knows: its own stages, and the whole before the first token.
    assert timings.frontend_seconds > 0
    assert timings.time_to_first_token_seconds >= timings.queue_seconds + timings.prefill_seconds


def test_phasescope_v1_beside_the_rust_server_cuts_the_text_at_a_stop_string(rust_server: RustServer) -> None:
    greedy = pb.SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0)
    request = pb.GenerateRequest(prompt="the quick brown fox", sampling=greedy)
    with Client(rust_server.v1_address, timeout_seconds=60) as client:
        whole = client.generate(request).text
        stop = whole[len(whole) // 2 : len(whole) // 2 + 3]
        request.sampling.stop.append(stop)
        chunks = list(client.generate_stream(request))
    assert "".join(chunk.text for chunk in chunks) == whole[: whole.index(stop)]
    assert chunks[-1].finish_reason == pb.FINISH_REASON_STOP


def test_phasescope_v1_beside_the_rust_server_refuses_bad_sampling_by_its_field_and_serves_on(
    rust_server: RustServer,
) -> None:
    # smg's Rust server hands a temperature of 5 to the engine core unchecked, whose input thread dies of it: the
    # request never gets that far.
    with Client(rust_server.v1_address, timeout_seconds=60) as client:
        for sampling, field in (
            (pb.SamplingParams(max_tokens=4, temperature=5.0), "sampling.temperature"),
            (pb.SamplingParams(max_tokens=4, bad_words=["fox"]), "sampling.bad_words"),
            # What vLLM's front end checks against the model: its grammar backend compiles the schema.
            (
                pb.SamplingParams(max_tokens=4, structured=pb.StructuredOutput(json_schema="{not json")),
                "sampling.structured.json_schema",
            ),
        ):
            with pytest.raises(grpc.RpcError) as refused:
                client.generate(pb.GenerateRequest(prompt="hello", sampling=sampling))
            assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert (refused.value.details() or "").startswith(field)
        assert client.generate(pb.GenerateRequest(prompt="hello", sampling=pb.SamplingParams(max_tokens=3))).text


def test_a_phasescope_v1_deadline_beside_the_rust_server_frees_the_engine(rust_server: RustServer) -> None:
    request = pb.GenerateRequest(prompt="long", sampling=pb.SamplingParams(max_tokens=2000, ignore_eos=True))
    with Client(rust_server.v1_address, timeout_seconds=60) as client, pytest.raises(grpc.RpcError) as ended:
        for _ in client.generate_stream(request, deadline_seconds=0.5):
            pass
    assert ended.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    # The engine dropped it: it runs nothing long before 2,000 tokens could have been made (several seconds).
    state = rust_server.server.wait_engine_idle(timeout=3)
    assert not state["running"], state


def test_phasescope_top_watches_the_engine_beside_the_rust_server(rust_server: RustServer) -> None:
    # WatchTelemetry on the phasescope.v1 port reads the hub's own aggregator: the engine whose requests came by
    # the Rust port, which the tests above sent.
    result = subprocess.run(
        [sys.executable, "-m", "phasescope", "top", "--address", rust_server.v1_address, "--once", "--width", "100"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert text.startswith("phasescope top · ")
    assert any(line.startswith("engine 0") for line in text.splitlines()), text
    assert any(line.startswith("decode ") for line in text.splitlines()), text
