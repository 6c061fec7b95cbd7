"""phasescope's physics behind front ends it does not run: smg's Rust request path (`--front-end rust`) and vLLM's
own OpenAI server (`--front-end external`), each engine core reporting its steps and requests to phasescope's hub.

Under 64 concurrent streams on the tiny model, the hub counts exactly what the engine did: the decode tokens the
clients received, the prompt tokens sent (no prefix cache), and each finished request's stages equal to vLLM's
own series where vLLM exports them.
"""

from __future__ import annotations

import asyncio
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from phasescope.bench.harness import ManagedProcess, free_port
from phasescope.bench.targets import VllmEngineTarget
from phasescope.bench.tiny_model import ensure_tiny_model
from phasescope.bench.workload import BenchRequest, RequestRecord
from phasescope.engine.vllm import TELEMETRY_SCHEDULER
from phasescope.telemetry.exposition import fetch_samples, sum_samples
from support.servers import ServerProcess

STREAMS = 64
OUTPUT_TOKENS = 24


def prompt(index: int) -> str:
    # Different from one another, so no prefix is shared whatever the cache does.
    return f"request {index}: the quick brown fox jumps over the lazy dog {index * 7919}"


def eventually(condition: Callable[[], bool], within_seconds: float = 15.0) -> None:
    """The engine cores' reports reach the hub a moment after the clients' answers."""
    deadline = time.monotonic() + within_seconds
    while not condition():
        assert time.monotonic() < deadline, "the hub never counted what the clients received"
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
    env = {"PHASESCOPE_TELEMETRY_ENDPOINT": hub.endpoint, "VLLM_LOGGING_LEVEL": "WARNING"}
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


@pytest.fixture(scope="module")
def rust_server(start_server: Callable[..., ServerProcess], tiny_model: Path) -> ServerProcess:
    return start_server(
        "--front-end",
        "rust",
        "--model",
        str(tiny_model),
        "--served-model-name",
        "tiny",
        "--max-concurrent-requests",
        str(STREAMS),
    )


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
    rust_server: ServerProcess, tiny_model: Path
) -> None:
    # The prefix cache off for the count: each prompt differs, and the cache is flushed first (the Rust server
    # serves vLLM's FlushCache as vLLM's worker does).
    rust_server.flush_prefix_cache()
    records = asyncio.run(_stream_all(rust_server.address, str(tiny_model)))
    assert all(record.output_tokens == OUTPUT_TOKENS for record in records)
    prompt_tokens = sum(record.prompt_tokens for record in records)
    assert_counts_what_the_engine_did(rust_server.metrics_url, prompt_tokens, STREAMS * OUTPUT_TOKENS)
