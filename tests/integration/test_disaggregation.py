"""Two phasescope workers as a disaggregated prefill/decode pair behind the real smg gateway, with the real OpenAI
SDK as the client (docs/disaggregation.md).

As that page runs it: the prefill worker's vLLM ExampleConnector is a `kv_producer`, the decode worker's a
`kv_consumer`, both on one folder; smg runs `--pd-disaggregation --prefill grpc://... --decode grpc://...`. Each
request's prompt goes first to the prefill worker (`max_tokens` 1), then the request to the decode worker, whose
connector loads the prompt's whole KV blocks (128 tokens on a CPU) from the folder and computes only the rest.

One pair and one gateway for the module, the gateway with tracing on and health checks every second. Found on smg
1.13 (the installed wheel), and asserted here:

- Trace context: smg continues the client's W3C `traceparent` (middleware/logging.rs extracts it) and injects its
  own context into both legs' gRPC metadata, so both workers' spans lie in the client's trace, under one gateway
  span. smg injects only with `--enable-trace` (`inject_trace_context_grpc` returns early when OpenTelemetry is
  off). Both legs also carry one request id, `<x-request-id>-<uuid7>`, which is the chat completion's `id`;
  phasescope shows a request's id only while it runs (WatchTelemetry), never on its spans.
- Hostile traffic: new long prompts at once overflow the prefill engine's step; vLLM's ExampleConnector then
  stores only the first chunk's KV under the whole prompt's name, and loading it fails, which alone ends the decode
  worker's engine. phasescope's connector has vLLM recompute the blocks of a failed load: the mixed batch here holds
  three new long prompts.
- Re-admission: a stopped worker stays registered (`/workers`: `is_healthy` false) and requests that need it are
  refused at once with 503; a new worker on the same address is taken back under the same worker id as soon as
  smg's health check reaches it, with no re-registration.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletion
from opentelemetry.proto.trace.v1 import trace_pb2

from phasescope.bench.harness import GatewayProcess
from phasescope.client.client import build_request, new_traceparent
from phasescope.telemetry.exposition import sum_samples
from phasescope.v1 import inference_pb2 as v1
from support.otlp import OtlpReceiver
from support.servers import ServerProcess

pytestmark = pytest.mark.integration

BLOCK_TOKENS = 128
"""vLLM's KV block on a CPU: the ExampleConnector moves whole blocks only."""
BY_SOURCE = "vllm:prompt_tokens_by_source_total"
IDLE = {"running": 0, "waiting": 0, "in_flight": 0}
ERROR_SECONDS = 30.0
"""A request the gateway cannot serve must be refused within this, not hang."""
GENERATE_SPAN = "/vllm.grpc.engine.VllmEngine/Generate"


def long_prompt(topic: str, notes: int = 60) -> str:
    """Several KV blocks of distinct sentences (60 notes: 978 tokens with the chat template), new for each
    topic. Under the prefill engine's step (2,048 tokens): the ExampleConnector stores only a prompt prefilled in
    one step whole (see the mixed-traffic test)."""
    text = " ".join(f"Note {index}: the {topic} house {index} has {index % 7 + 2} windows." for index in range(notes))
    return f"{text} Which {topic} house has the most windows?"


@dataclass
class Pair:
    """The two workers, the folder their connectors share, and each configuration (to start a worker again). Every
    worker, a restarted one too, stops with the module (conftest.Servers)."""

    prefill: ServerProcess
    decode: ServerProcess
    store: Path
    prefill_args: tuple[str, ...]


def connector_args(store: Path, role: str, otlp_receiver: OtlpReceiver) -> tuple[str, ...]:
    config = {
        "kv_connector": "ExampleConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": str(store)},
    }
    return ("--kv-transfer-config", json.dumps(config), "--otlp-endpoint", f"http://127.0.0.1:{otlp_receiver.port}")


# Spans leave every 100 ms (as the shared traced server's do), so a test sees them quickly.
TRACE_ENV = {"OTEL_BSP_SCHEDULE_DELAY": "100"}


@pytest.fixture(scope="module")
def pair(
    start_server: Callable[..., ServerProcess],
    otlp_receiver: OtlpReceiver,
    tmp_path_factory: pytest.TempPathFactory,
) -> Pair:
    store = tmp_path_factory.mktemp("kv-store")
    prefill_args = connector_args(store, "kv_producer", otlp_receiver)
    # Both load at once (their start-up is mostly waiting on the cores in turn).
    prefill = start_server(*prefill_args, wait=False, env=TRACE_ENV)
    decode = start_server(*connector_args(store, "kv_consumer", otlp_receiver), wait=False, env=TRACE_ENV)
    prefill.wait_serving()
    decode.wait_serving()
    return Pair(prefill, decode, store, prefill_args)


@pytest.fixture(scope="module")
def gateway(
    pair: Pair, default_model: Path, otlp_receiver: OtlpReceiver, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    log = tmp_path_factory.mktemp("gateway") / "smg.log"
    pd = [
        "--pd-disaggregation",
        "--prefill",
        f"grpc://{pair.prefill.address}",
        "--decode",
        f"grpc://{pair.decode.address}",
    ]
    # A probe every second, two misses to mark a worker down, one answer to take it back (defaults: 60 s, 3, 2).
    health = ["--health-check-interval-secs", "1", "--health-failure-threshold", "2", "--health-success-threshold", "1"]
    # smg gives up on a prefill leg that answers nothing within its silence bound: with the default
    # --worker-wedge-secs (3) it answered 504 "Prefill worker silent: prefill leg produced nothing within 3.0s of its
    # dispatch" to three long prompts at once on two CPU cores, and with 60 it waited for them.
    patience = ["--worker-wedge-secs", "60"]
    tracing = ["--enable-trace", "--otlp-traces-endpoint", f"127.0.0.1:{otlp_receiver.port}"]
    with GatewayProcess([], default_model, log, extra_args=[*pd, *health, *patience, *tracing]) as process:
        process.wait_ready()
        yield process


@dataclass(frozen=True)
class Front:
    """The gateway as a client sees it: the OpenAI SDK, and the model the gateway serves."""

    client: openai.OpenAI
    model: str

    def chat(self, content: str, max_tokens: int = 16, timeout: float = 120, **options: Any) -> ChatCompletion:
        """A greedy chat through the gateway."""
        answer: ChatCompletion = self.client.with_options(timeout=timeout).chat.completions.create(
            model=self.model,
            messages=[{"role": "user", "content": content}],
            max_tokens=max_tokens,
            temperature=0,
            **options,
        )
        return answer


@pytest.fixture(scope="module")
def front(gateway: GatewayProcess) -> Iterator[Front]:
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", timeout=120, max_retries=0) as client:
        yield Front(client, gateway.models()[0])


COUNTED = {
    "external": (BY_SOURCE, {"source": "external_kv_transfer"}),
    "computed": (BY_SOURCE, {"source": "local_compute"}),
    "cache_hit": (BY_SOURCE, {"source": "local_cache_hit"}),
    "generated": ("vllm:generation_tokens_total", {}),
    "requests": ("phasescope_requests_total", {}),
    "loaded": ("phasescope_kv_transfer_tokens_total", {"direction": "loaded"}),
    "saved": ("phasescope_kv_transfer_tokens_total", {"direction": "saved"}),
    "prefill_computed": ("phasescope_tokens_total", {"phase": "prefill"}),
    "prefix_cached": ("phasescope_prefix_cache_hit_tokens_total", {}),
}
"""What each worker's /metrics counts, vLLM's series and phasescope's own."""


def counts(server: ServerProcess) -> dict[str, float]:
    samples = server.samples()
    return {key: sum_samples(samples, name, **labels) for key, (name, labels) in COUNTED.items()}


def settled_delta(
    server: ServerProcess, before: dict[str, float], done: Callable[[dict[str, float]], bool]
) -> dict[str, float]:
    """The counts' growth since `before`, once the engine is idle and `done` holds (vLLM's series follow the
    answer by a step), or as they stand after 10 s."""
    server.wait_engine_idle(timeout=60)
    deadline = time.monotonic() + 10
    while True:
        now = counts(server)
        delta = {key: now[key] - before[key] for key in now}
        if done(delta) or time.monotonic() > deadline:
            return delta
        time.sleep(0.2)


@dataclass(frozen=True)
class LongChat:
    answer: ChatCompletion
    prefill: dict[str, float]
    decode: dict[str, float]


@pytest.fixture(scope="module")
def long_chat(pair: Pair, front: Front) -> LongChat:
    """One greedy chat through the gateway whose prompt is several KV blocks long, and what each worker counted."""
    before = counts(pair.prefill), counts(pair.decode)
    answer = front.chat(long_prompt("red"))
    prefill = settled_delta(pair.prefill, before[0], lambda d: d["generated"] >= 1 and d["saved"] > 0)
    decode = settled_delta(pair.decode, before[1], lambda d: d["generated"] >= 16 and d["external"] > 0)
    return LongChat(answer, prefill, decode)


def empty(store: Path) -> None:
    for entry in store.iterdir():
        if entry.is_dir():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def test_a_greedy_chat_through_the_pair_answers_as_one_worker_alone(
    long_chat: LongChat, pair: Pair, front: Front
) -> None:
    answer = long_chat.answer
    assert answer.usage is not None
    assert answer.usage.prompt_tokens > 2 * BLOCK_TOKENS
    assert answer.choices[0].message.content
    # The same chat on the prefill worker alone, over phasescope's own protocol, with nothing to load: the store
    # emptied and the worker's prefix cache flushed, so it computes the whole prompt itself.
    empty(pair.store)
    pair.prefill.flush_prefix_cache()
    with pair.prefill.client() as client:
        alone = client.generate(build_request(chat=[("user", long_prompt("red"))], temperature=0.0, max_tokens=16))
    assert (alone.usage.cached_prompt_tokens, alone.timings.kv_loaded_tokens) == (0, 0)
    # The same prompt (the gateway's chat template and the worker's agree) and the same answer.
    assert alone.usage.prompt_tokens == answer.usage.prompt_tokens
    assert alone.usage.completion_tokens == answer.usage.completion_tokens
    assert answer.choices[0].message.content == alone.text


def test_the_decode_worker_loads_the_prompts_whole_blocks_and_computes_only_the_rest(long_chat: LongChat) -> None:
    answer, decode = long_chat.answer, long_chat.decode
    assert answer.usage is not None
    prompt_tokens = answer.usage.prompt_tokens
    transferred, computed, hit = decode["external"], decode["computed"], decode["cache_hit"]
    # Whole blocks came through the connector: every block but the one holding the prompt's last tokens.
    assert transferred >= 2 * BLOCK_TOKENS
    assert transferred % BLOCK_TOKENS == 0
    assert transferred + computed + hit == prompt_tokens
    assert hit == 0  # a prompt it had never seen
    assert 0 < computed <= BLOCK_TOKENS + 1
    # phasescope's figures are vLLM's: the tokens loaded, the prompt the prefix cache (connector included) held,
    # and what prefill computed.
    assert decode["loaded"] == transferred
    assert decode["prefix_cached"] == transferred + hit
    assert decode["prefill_computed"] == computed
    # The decode worker generated the whole answer, for this one request.
    assert decode["generated"] == answer.usage.completion_tokens
    assert decode["requests"] == 1


def test_the_prefill_worker_emits_at_most_one_token_per_request(long_chat: LongChat, pair: Pair, front: Front) -> None:
    # The long chat's prefill leg: the whole prompt computed there and saved for the decode worker, one token.
    assert long_chat.answer.usage is not None
    prompt_tokens = long_chat.answer.usage.prompt_tokens
    assert long_chat.prefill["requests"] == 1
    assert long_chat.prefill["generated"] <= 1
    assert long_chat.prefill["computed"] == prompt_tokens
    assert long_chat.prefill["saved"] == prompt_tokens
    # More requests: each reaches the prefill worker once, which still emits at most a token for each.
    before = counts(pair.prefill), counts(pair.decode)
    answers = [front.chat(question, max_tokens=8) for question in ("Hi", "What is 2 + 2?", "Name a fruit.")]
    completion_tokens = sum(a.usage.completion_tokens for a in answers if a.usage is not None)
    prefill = settled_delta(pair.prefill, before[0], lambda d: d["requests"] >= 3)
    decode = settled_delta(pair.decode, before[1], lambda d: d["generated"] >= completion_tokens)
    assert prefill["requests"] == 3
    assert 1 <= prefill["generated"] <= 3
    assert decode["generated"] == completion_tokens


def test_short_repeated_and_mixed_concurrent_traffic_is_all_answered_and_the_pair_keeps_serving(
    pair: Pair, front: Front
) -> None:
    # Prompts shorter than one block, again and again: nothing to transfer, the decode worker computes them.
    before = counts(pair.decode)
    for _ in range(4):
        answer = front.chat("Hi", max_tokens=4)
        assert answer.choices[0].finish_reason in ("length", "stop")
        assert answer.usage is not None
        assert answer.usage.prompt_tokens < BLOCK_TOKENS
    decode = settled_delta(pair.decode, before, lambda d: d["requests"] >= 4)
    assert decode["requests"] == 4
    assert decode["external"] == 0
    # Short prompts and new long ones at once. Three new long prompts overflow the prefill engine's step (2,048
    # tokens): the later ones are prefilled in chunks, vLLM's ExampleConnector stores only a first chunk's KV under
    # the whole prompt's name, and loading it fails ("shape mismatch"), which alone ends the decode worker's engine;
    # phasescope's connector has vLLM recompute those blocks.
    questions = ["Hi", long_prompt("blue"), "Hello there", long_prompt("green"), long_prompt("brown"), "Hi"]
    with ThreadPoolExecutor(len(questions)) as pool:
        answers = list(pool.map(lambda question: front.chat(question, max_tokens=8), questions))
    for answer in answers:
        assert answer.choices[0].finish_reason in ("length", "stop")
        assert answer.choices[0].message.content
    for server in (pair.prefill, pair.decode):
        assert server.wait_engine_idle(timeout=60) == IDLE
        assert server.health() == "SERVING"
        with server.client() as client:
            assert client.model_info().kv_connector == "ExampleConnector"
    # And the pair still moves a long prompt's KV.
    before = counts(pair.decode)
    assert front.chat(long_prompt("yellow"), max_tokens=4).choices[0].message.content
    assert settled_delta(pair.decode, before, lambda d: d["external"] > 0)["external"] >= 2 * BLOCK_TOKENS


def attributes(span: trace_pb2.Span) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for attribute in span.attributes:
        value = attribute.value
        values[attribute.key] = getattr(value, value.WhichOneof("value") or "string_value")
    return values


def test_both_legs_lie_in_the_callers_trace_and_carry_one_request_id(
    pair: Pair, front: Front, otlp_receiver: OtlpReceiver
) -> None:
    traceparent, trace_id = new_traceparent()
    # Each worker's requests in flight, by id, as WatchTelemetry shows them while they run.
    seen: dict[str, set[str]] = {"prefill": set(), "decode": set()}
    watching = threading.Event()
    done = threading.Event()

    def watch(leg: str, server: ServerProcess) -> None:
        with server.client(timeout_seconds=None) as client:
            snapshots = client.watch_telemetry(v1.WatchTelemetryRequest(interval_seconds=0.25))
            try:
                for snapshot in snapshots:
                    watching.set()
                    seen[leg].update(request.request_id for request in snapshot.requests)
                    if done.is_set():
                        return
            finally:
                snapshots.cancel()  # type: ignore[attr-defined]  # the call object is also a grpc.Future

    watchers = [
        threading.Thread(target=watch, args=item) for item in (("prefill", pair.prefill), ("decode", pair.decode))
    ]
    for watcher in watchers:
        watcher.start()
    try:
        assert watching.wait(10)
        # A long prompt new to both workers: the prefill leg computes it, long enough for a snapshot to see it.
        answer = front.chat(
            long_prompt("purple", notes=110),
            max_tokens=24,
            extra_headers={"traceparent": traceparent, "x-request-id": "pd-traced"},
            extra_body={"ignore_eos": True},
        )
        time.sleep(0.6)
    finally:
        done.set()
        for watcher in watchers:
            watcher.join(timeout=10)
    # One request id on both legs: the caller's x-request-id with a suffix, and the completion's id.
    assert answer.id.startswith("pd-traced-")
    assert seen == {"prefill": {answer.id}, "decode": {answer.id}}

    # On each worker: its gRPC server span, the request span under it, and the request's stages under that.
    assert answer.usage is not None
    deadline = time.monotonic() + 20
    while True:
        spans = otlp_receiver.spans(trace_id)
        legs = [span for span in spans if span.name == GENERATE_SPAN]
        requests = {
            span.parent_span_id: span for span in spans if any(span.parent_span_id == leg.span_id for leg in legs)
        }
        transfers = {span.parent_span_id: span for span in spans if span.name == "kv_transfer"}
        if (len(legs), len(requests), len(transfers)) == (2, 2, 2) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert len(legs) == 2, [span.name for span in spans]
    # Both legs hang off one gateway span: the caller's span -> smg's http_request -> grpc_execute -> each leg.
    by_id = {span.span_id: span for span in spans}
    gateway_span = by_id[legs[0].parent_span_id]
    assert legs[1].parent_span_id == gateway_span.span_id
    assert gateway_span.name == "grpc_execute"
    assert by_id[gateway_span.parent_span_id].name == "http_request"
    assert by_id[gateway_span.parent_span_id].parent_span_id == bytes.fromhex(traceparent.split("-")[2])
    # Which leg is which: the prefill leg's one token, and the decode leg's whole answer.
    by_output = {attributes(span)["gen_ai.usage.output_tokens"]: span for span in requests.values()}
    assert sorted(by_output) == [1, answer.usage.completion_tokens]
    prefill_leg, decode_leg = by_output[1], by_output[answer.usage.completion_tokens]
    # The prefill leg computed the prompt and saved it; the decode leg loaded its whole blocks.
    saved = attributes(transfers[prefill_leg.span_id])
    assert (saved["phasescope.kv_loaded_tokens"], saved["phasescope.kv_saved_tokens"]) == (
        0,
        answer.usage.prompt_tokens,
    )
    loaded = attributes(transfers[decode_leg.span_id])["phasescope.kv_loaded_tokens"]
    assert loaded >= 2 * BLOCK_TOKENS
    assert loaded % BLOCK_TOKENS == 0


def gateway_workers(gateway: GatewayProcess) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"{gateway.url}/workers", timeout=5) as response:
        workers: list[dict[str, Any]] = json.loads(response.read())["workers"]
    return workers


def prefill_entry(gateway: GatewayProcess) -> dict[str, Any]:
    (entry,) = [worker for worker in gateway_workers(gateway) if worker["worker_type"] == "prefill"]
    return entry


def test_a_stopped_prefill_worker_is_refused_promptly_and_one_started_on_its_address_is_taken_back(
    pair: Pair,
    gateway: GatewayProcess,
    front: Front,
    start_server: Callable[..., ServerProcess],
) -> None:
    """smg keeps a worker that stopped answering registered and marks it unhealthy; while it is down, requests
    get 503 at once (nothing reaches the decode worker), and a new worker on the same address is taken back under
    the same worker id once smg's health check reaches it."""
    registered = prefill_entry(gateway)
    assert registered["url"] == f"grpc://{pair.prefill.address}"
    assert registered["is_healthy"]
    old = pair.prefill
    decode_before = counts(pair.decode)
    old.stop()
    for _ in range(3):
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as refused:
            front.chat(timeout=2 * ERROR_SECONDS, content="Hi", max_tokens=4)
        assert time.monotonic() - started < ERROR_SECONDS
        assert refused.value.status_code >= 500
    deadline = time.monotonic() + 15
    while prefill_entry(gateway)["is_healthy"]:
        assert time.monotonic() < deadline, "the gateway still lists the stopped worker as healthy"
        time.sleep(0.2)
    # Nothing was sent on to the decode worker, and it runs and queues nothing.
    assert pair.decode.wait_engine_idle(timeout=30) == IDLE
    samples = pair.decode.samples()
    assert sum_samples(samples, "vllm:num_requests_running") == sum_samples(samples, "vllm:num_requests_waiting") == 0
    assert counts(pair.decode)["requests"] == decode_before["requests"]
    assert pair.decode.health() == "SERVING"

    # The same configuration on the same port (the last --port wins over the harness's own).
    again = start_server(*pair.prefill_args, "--port", str(old.port), wait=False, env=TRACE_ENV)
    again.port, again.address = old.port, old.address
    pair.prefill = again
    again.wait_serving()
    served_at = time.monotonic()
    deadline = served_at + 60
    while True:
        try:
            front.chat(timeout=ERROR_SECONDS, content="Hi", max_tokens=2)
            break
        except openai.APIStatusError:
            assert time.monotonic() < deadline, "the gateway never took the worker back"
            time.sleep(0.5)
    entry = prefill_entry(gateway)
    assert (entry["id"], entry["url"], entry["is_healthy"]) == (registered["id"], registered["url"], True)
    # The pair works again: a long prompt's KV moves from the new prefill worker to the decode worker.
    before = counts(again), counts(pair.decode)
    answer = front.chat(long_prompt("orange"), max_tokens=4)
    assert answer.choices[0].message.content
    assert settled_delta(again, before[0], lambda d: d["saved"] > 0)["requests"] == 1
    assert settled_delta(pair.decode, before[1], lambda d: d["external"] > 0)["external"] >= 2 * BLOCK_TOKENS
