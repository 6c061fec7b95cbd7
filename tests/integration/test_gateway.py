"""phasescope as a vLLM gRPC worker behind the real smg gateway, with the real OpenAI SDK as the client.

The gateway registers the worker over vLLM's engine protocol (HealthCheck, GetModelInfo,
GetServerInfo), tokenises and detokenises itself, and drives Generate with token ids; phasescope
times and exports every such request as it does its own protocol's.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from phasescope.bench.harness import GatewayProcess, free_port
from phasescope.bench.targets import load_tokenizer
from phasescope.bench.tiny_model import ensure_tiny_model
from phasescope.serve.timings import TIMINGS_METADATA_KEY
from phasescope.telemetry.exposition import sum_samples
from phasescope.v1 import inference_pb2 as v1
from support.engine_protocol import open_engine_stub
from support.servers import ServerProcess

pytestmark = pytest.mark.integration

# smg pings each worker connection every 30 s (crates/grpc_client): a worker that counts those as
# strikes ends the connection with GOAWAY(too_many_pings).
GATEWAY_PING_SECONDS = 30.0


@pytest.fixture(scope="module")
def gateway(
    server: ServerProcess, default_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    log = tmp_path_factory.mktemp("gateway") / "smg.log"
    with GatewayProcess([server.address], default_model, log) as process:
        process.wait_ready()
        yield process


@pytest.fixture
def openai_client(gateway: GatewayProcess) -> Iterator[openai.OpenAI]:
    # Closed after the test: an unclosed client's sockets are collected later, in another test, as a warning.
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", timeout=120, max_retries=0) as client:
        yield client


CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the capital of France?"}]
STORY: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Write a very long story."}]


def test_a_greedy_chat_through_the_gateway_answers_and_is_counted(
    openai_client: openai.OpenAI, gateway: GatewayProcess, server: ServerProcess
) -> None:
    before = server.sample_sum("phasescope_requests_total", code="OK", finish_reason="stop")
    decoded_before = server.sample_sum("phasescope_request_phase_seconds_count", phase="decode")
    answer = openai_client.chat.completions.create(
        model=gateway.models()[0],
        messages=CHAT,
        temperature=0,
        max_tokens=32,
    )
    assert answer.choices[0].message.content == "The capital of France is Paris."
    streamed = openai_client.chat.completions.create(
        model=gateway.models()[0],
        messages=CHAT,
        temperature=0,
        max_tokens=32,
        stream=True,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    assert text == "The capital of France is Paris."
    server.wait_engine_idle()
    assert server.sample_sum("phasescope_requests_total", code="OK", finish_reason="stop") == before + 2
    assert server.sample_sum("phasescope_request_phase_seconds_count", phase="decode") == decoded_before + 2


def test_a_json_schema_response_format_and_logprobs_work_through_the_gateway(
    openai_client: openai.OpenAI, gateway: GatewayProcess
) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 16}},
        "required": ["city"],
        "additionalProperties": False,
    }
    answer = openai_client.chat.completions.create(
        model=gateway.models()[0],
        messages=CHAT,
        temperature=0,
        max_tokens=48,
        response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": schema}},
    )
    jsonschema.validate(json.loads(answer.choices[0].message.content or ""), schema)
    scored = openai_client.chat.completions.create(
        model=gateway.models()[0], messages=CHAT, temperature=0, max_tokens=8, logprobs=True, top_logprobs=2
    )
    content = scored.choices[0].logprobs.content if scored.choices[0].logprobs else None
    assert content
    for token in content:
        assert len(token.top_logprobs) == 2
        assert token.top_logprobs[0].logprob == pytest.approx(token.logprob)


def test_n_samples_through_the_gateway_are_n_choices_each_counted_as_its_own_sequence(
    openai_client: openai.OpenAI, gateway: GatewayProcess, server: ServerProcess
) -> None:
    server.wait_engine_idle()
    requests_before = server.sample_sum("phasescope_requests_total", code="OK")
    decoded_before = server.sample_sum("phasescope_request_phase_seconds_count", phase="decode")
    answer = openai_client.chat.completions.create(
        model=gateway.models()[0], messages=STORY, temperature=1.0, seed=3, max_tokens=12, n=2
    )
    assert sorted(choice.index for choice in answer.choices) == [0, 1]
    assert all(choice.message.content for choice in answer.choices)
    assert answer.usage is not None
    server.wait_engine_idle()
    assert server.sample_sum("phasescope_requests_total", code="OK") == requests_before + 1
    assert server.sample_sum("phasescope_request_phase_seconds_count", phase="decode") == decoded_before + 2


def test_the_trailing_timings_are_what_the_metrics_observed(server: ServerProcess) -> None:
    stages = ("frontend", "intake", "queue", "prefill", "decode")
    server.wait_engine_idle()
    before = {stage: server.sample_sum("phasescope_request_phase_seconds_sum", phase=stage) for stage in stages}
    with open_engine_stub(server.address) as engine:
        request = pb.GenerateRequest(
            request_id="timed", tokenized=pb.TokenizedInput(input_ids=[1, 504, 3458]),
            sampling_params=pb.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), stream=True,
        )  # fmt: skip
        call = engine.Generate(request)
        responses = list(call)
        trailing = dict(call.trailing_metadata())
    assert responses[-1].complete.completion_tokens >= 1
    timings = v1.Timings.FromString(trailing[TIMINGS_METADATA_KEY])
    server.wait_engine_idle()
    for stage in stages:
        observed = server.sample_sum("phasescope_request_phase_seconds_sum", phase=stage) - before[stage]
        assert observed == pytest.approx(getattr(timings, f"{stage}_seconds"), abs=1e-6), stage


def test_a_client_that_drops_mid_decode_frees_the_engines_request(
    openai_client: openai.OpenAI, gateway: GatewayProcess, server: ServerProcess
) -> None:
    aborted_before = server.sample_sum("phasescope_requests_total", finish_reason="abort")
    stream = openai_client.chat.completions.create(
        model=gateway.models()[0],
        messages=STORY,
        max_tokens=1500,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for index, _ in enumerate(stream):
        if index == 4:
            break
    stream.close()
    # The gateway aborts the worker's request: the engine runs nothing, as vLLM's own series says.
    deadline = time.monotonic() + 30
    while server.sample_sum("vllm:num_requests_running") or server.sample_sum("phasescope_requests_in_flight"):
        assert time.monotonic() < deadline, "the dropped request kept running in the engine"
        time.sleep(0.2)
    assert server.sample_sum("phasescope_requests_total", finish_reason="abort") == aborted_before + 1


def test_get_loads_agrees_with_the_metrics(server: ServerProcess) -> None:
    server.wait_engine_idle()
    with open_engine_stub(server.address) as engine:
        loads = engine.GetLoads(pb.GetLoadsRequest())
    samples = server.samples()
    (load,) = loads.loads
    running = sum_samples(samples, "phasescope_engine_requests", state="running")
    waiting = sum_samples(samples, "phasescope_engine_requests", state="waiting")
    assert (load.num_running_reqs, load.num_waiting_reqs) == (running, waiting)
    assert load.token_usage == pytest.approx(sum_samples(samples, "phasescope_kv_cache_usage_ratio"))
    # The KV cache's capacity is the engine's own: blocks × tokens per block, as vLLM's cache_config_info says.
    config = dict(next(labels for (name, labels) in samples if name == "vllm:cache_config_info"))
    assert load.max_total_num_tokens == int(config["num_gpu_blocks"]) * int(config["block_size"])
    assert load.max_running_requests > 0


FRONT_ENDS = ("rust", "python")
PAIR_CONTEXT = 512
"""The worker pair's context: issue 46's answer runs to its end, so a short one keeps that answer short."""


@pytest.fixture(scope="module")
def worker_pair(start_server: Callable[..., ServerProcess]) -> list[ServerProcess]:
    """Two workers of the tiny random-weight model (cheap on a small machine), each publishing its KV-cache
    events, started as an operator would (no --served-model-name): the first behind smg's Rust request path, the
    second behind phasescope's own (FRONT_ENDS), so that each routing test crosses both."""
    workers = []
    for front_end in FRONT_ENDS:
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{free_port()}"}
        workers.append(
            start_server(
                "--front-end", front_end, "--model", str(ensure_tiny_model()), "--kv-events-config", json.dumps(events),
                "--max-model-len", str(PAIR_CONTEXT), wait=False,
            )
        )  # fmt: skip
    for worker in workers:
        worker.wait_serving()
    return workers


@pytest.fixture(scope="module")
def cache_aware_gateway(worker_pair: list[ServerProcess], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    log = tmp_path_factory.mktemp("gateway") / "smg.log"
    with GatewayProcess([w.address for w in worker_pair], ensure_tiny_model(), log, policy="cache_aware") as gateway:
        gateway.wait_ready()
        with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", timeout=120, max_retries=0) as client:
            yield client


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_the_model_path_is_its_id_and_max_tokens_at_the_contexts_size_runs_to_its_end(
    worker_pair: list[ServerProcess], front_end: str, tmp_path: Path
) -> None:
    # Guards issue 46's two cases, as smg's own e2e suite sends them: the model by its --model path (404 when
    # the worker named it by the folder's last part), and max_tokens at the context's size (refused before).
    # A gateway of its own in front of that one worker, so the answer is that front end's.
    worker = worker_pair[FRONT_ENDS.index(front_end)]
    with GatewayProcess([worker.address], ensure_tiny_model(), tmp_path / "smg.log") as gateway:
        gateway.wait_ready()
        with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", timeout=120, max_retries=0) as client:
            assert [model.id for model in client.models.list()] == [str(ensure_tiny_model())]
            answer = client.completions.create(
                model=str(ensure_tiny_model()), prompt="Hi", max_tokens=PAIR_CONTEXT, temperature=0
            )
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage is not None
    assert answer.usage.prompt_tokens + answer.usage.completion_tokens == PAIR_CONTEXT


def test_cache_aware_routing_sends_a_prefix_to_the_worker_whose_kv_events_say_it_holds_it(
    cache_aware_gateway: openai.OpenAI, worker_pair: list[ServerProcess]
) -> None:
    # Each long prefix is prefilled on one worker directly, behind the gateway's back: only that worker's KV-cache
    # events can tell the gateway where its blocks are. Six prefixes, alternating holders: luck would place all
    # six right once in 64 runs.
    def words(topic: int) -> str:
        return " ".join(f"topic{topic} word{index}" for index in range(90))  # 3 whole KV blocks and more

    # Token ids, as the gateway sends them (smg's Rust request path takes nothing else).
    tokenizer = load_tokenizer(str(ensure_tiny_model()))
    for topic in range(6):
        with open_engine_stub(worker_pair[topic % 2].address) as engine:
            primed = pb.GenerateRequest(
                request_id=f"prime-{topic}",
                tokenized=pb.TokenizedInput(input_ids=list(tokenizer.encode(words(topic)))),
                sampling_params=pb.SamplingParams(max_tokens=1),
            )
            list(engine.Generate(primed))
    time.sleep(1.0)  # the events' way to the gateway
    for topic in range(6):
        before = [worker.sample_sum("phasescope_requests_total") for worker in worker_pair]
        cache_aware_gateway.completions.create(
            model=str(ensure_tiny_model()), prompt=words(topic) + " and then", max_tokens=2, temperature=0
        )
        # Once the holder has counted it (behind the Rust path a request is counted from its engine core's record,
        # which reaches the hub a moment after the answer), or in 20 s.
        deadline = time.monotonic() + 20.0
        while True:
            served = [
                worker.sample_sum("phasescope_requests_total") - b
                for worker, b in zip(worker_pair, before, strict=True)
            ]
            if served[topic % 2] >= 1 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert served[topic % 2] == 1, (topic, served)


def test_each_kv_event_batch_carries_the_workers_load_and_an_idle_stream_its_heartbeats(
    worker_pair: list[ServerProcess],
) -> None:
    # As vLLM's worker stamps its batches: the load record (GetLoads' figures) on every batch, and `load_only`
    # batches (the last sequence repeated) while no events flow. phasescope's relay, behind its own front end (the
    # Rust server has its own).
    worker = worker_pair[FRONT_ENDS.index("python")]
    worker.wait_engine_idle()
    batches: list[common_pb2.KvEventBatch] = []
    with open_engine_stub(worker.address) as engine:
        loads = engine.GetLoads(pb.GetLoadsRequest())
        stream = engine.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), timeout=120)
        stream.initial_metadata()  # subscribed
        seen = threading.Event()

        def prefill_until_events_flow() -> None:
            # New prefixes store new blocks: their events open the stream (ZMQ's subscription may join late).
            for attempt in range(20):
                request = pb.GenerateRequest(
                    request_id=f"loaded-{attempt}", text=" ".join(f"load{attempt} word{i}" for i in range(80)),
                    sampling_params=pb.SamplingParams(max_tokens=64, ignore_eos=True),
                )  # fmt: skip
                list(engine.Generate(request))
                if seen.wait(0.5):
                    return

        generating = threading.Thread(target=prefill_until_events_flow)
        generating.start()
        try:
            for batch in stream:
                batches.append(batch)
                if batch.events:
                    seen.set()
                idle = not generating.is_alive()
                if idle and batch.load.load_only and batch.load.running_requests == 0:
                    break
        finally:
            stream.cancel()
            seen.set()
            generating.join()
    (load,) = loads.loads
    events = [batch for batch in batches if batch.events]
    assert events, "no KV event came"
    assert all(batch.HasField("load") for batch in batches)
    assert not any(batch.load.load_only for batch in events)
    for batch in batches:
        assert 0 <= batch.load.running_requests <= load.max_running_requests
        assert 0.0 <= batch.load.token_usage <= 1.0
        assert batch.load.max_running_requests == load.max_running_requests
    assert max(batch.load.running_requests for batch in batches) == 1
    assert max(batch.load.token_usage for batch in batches) > 0.0
    # The stream's first record and its heartbeats carry the telemetry beyond the routing core.
    heartbeat, relayed = batches[-1], [batch for batch in batches if not batch.load.load_only]
    assert heartbeat.sequence_number == relayed[-1].sequence_number
    for record in (batches[0].load, heartbeat.load):
        assert record.max_total_num_tokens == load.max_total_num_tokens > 0
    assert [batch.load.sample for batch in batches] == list(range(1, len(batches) + 1))
    # No drafts on this worker: no speculative section.
    assert not any(batch.load.HasField("speculative") for batch in batches)


def test_one_worker_stopping_mid_run_leaves_the_other_serving(
    cache_aware_gateway: openai.OpenAI, worker_pair: list[ServerProcess]
) -> None:
    def complete() -> None:
        answer = cache_aware_gateway.completions.create(
            model=str(ensure_tiny_model()), prompt="Hello", max_tokens=8, temperature=0
        )
        assert answer.choices[0].finish_reason == "length"

    def counted(workers: list[ServerProcess], at_least: float) -> float:
        # Behind the Rust request path a request is counted from its engine core's record, a moment after its
        # answer: the workers' total once it has reached `at_least`, or after 20 s.
        deadline = time.monotonic() + 20.0
        while True:
            total = sum(worker.sample_sum("phasescope_requests_total", code="OK") for worker in workers)
            if total >= at_least or time.monotonic() > deadline:
                return total
            time.sleep(0.05)

    before = counted(worker_pair, 0)
    for _ in range(3):
        complete()
    counted(worker_pair, before + 3)
    served_before = worker_pair[1].sample_sum("phasescope_requests_total", code="OK")
    # One worker drains and exits mid-run; every later request is still answered, by the other.
    worker_pair[0].stop()
    for _ in range(6):
        complete()
    assert counted(worker_pair[1:], served_before + 6) == served_before + 6


def test_an_idle_gateway_pinging_past_its_interval_keeps_its_connection(
    openai_client: openai.OpenAI, gateway: GatewayProcess
) -> None:
    # Last in the module: by now the gateway's connection has lived through the tests before (those of the worker
    # pair use gateways of their own), so the wait is short or none.
    idle_until = gateway.ready_at + GATEWAY_PING_SECONDS + 5
    time.sleep(max(0.0, idle_until - time.monotonic()))
    answer = openai_client.chat.completions.create(
        model=gateway.models()[0],
        messages=CHAT,
        temperature=0,
        max_tokens=8,
    )
    assert answer.choices[0].message.content
    log = gateway.log_path.read_text(errors="replace").lower()
    assert "too_many_pings" not in log
    assert "goaway" not in log
