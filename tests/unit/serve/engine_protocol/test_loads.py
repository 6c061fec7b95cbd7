"""The load record each SubscribeKvEvents batch carries (phasescope.serve.engine_protocol.loads.engine_load): GetLoads'
figures field for field, and the window's speculative decoding when the engine verified drafts in it."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from phasescope.engine.base import KvEventPublisher, ModelDescription
from phasescope.serve.engine_protocol.loads import engine_load, scheduler_loads
from phasescope.telemetry.hardware.peaks import HardwarePeaks
from phasescope.telemetry.model.speculation import Drafter
from phasescope.telemetry.step.aggregator import EngineView, StepAggregator
from phasescope.telemetry.step.records import SchedulerState, SpeculativeStep, StepRecord, StepReport
from support.fake_engine import ScriptedEngine
from support.served import served

PEAKS = HardwarePeaks("toy", 100e9, {"fp32": 1e12}, "flag", "toy")
K = 3
# The core every record carries, and the GetLoads field each one is.
CORE = {
    "running_requests": "num_running_reqs",
    "waiting_requests": "num_waiting_reqs",
    "waiting_uncached_tokens": "num_waiting_uncached_tokens",
    "token_usage": "token_usage",
    "gen_throughput": "gen_throughput",
    "max_running_requests": "max_running_requests",
    "num_used_tokens": "num_used_tokens",
    "max_total_num_tokens": "max_total_num_tokens",
}


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def description(ranks: int = 1) -> ModelDescription:
    return dataclasses.replace(ScriptedEngine().description, data_parallel_size=ranks)


def views(steps: list[StepReport], ranks: int = 1, drafter: Drafter | None = None) -> list[EngineView]:
    """The aggregator's views after `steps`, each taking its elapsed time on the clock."""
    clock = FakeClock()
    described = description(ranks)
    aggregator = StepAggregator(
        described.cost,
        described.dtype,
        PEAKS,
        engines=ranks,
        window_seconds=10.0,
        clock=clock,
        kv_cache_capacity_tokens=described.kv_cache_capacity_tokens,
        drafter=drafter,
    )
    for report in steps:
        clock.now += report.step.elapsed_seconds if report.step is not None else 0.0
        aggregator.record(report)
    return aggregator.views()[1]


def decoding(engine: int = 0, running: int = 3, waiting: int = 2, usage: float = 0.25) -> StepReport:
    return StepReport(
        scheduler=SchedulerState(engine, running=running, waiting=waiting, kv_cache_usage=usage),
        step=StepRecord(engine, 0, 0, running, running, 0.05, flops=1e9, read_bytes=5e9),
    )


def verifying(engine: int = 0, sequences: int = 4, accepted: int = 6) -> StepReport:
    """A decode step verifying K drafts per sequence, `accepted` of them kept."""
    return StepReport(
        scheduler=SchedulerState(engine, running=sequences, waiting=0, kv_cache_usage=0.5),
        step=StepRecord(
            engine,
            0,
            0,
            sequences,
            sequences * (K + 1),
            0.05,
            speculative=SpeculativeStep(sequences, sequences * K, accepted),
        ),
    )


def test_the_record_is_get_loads_figures_field_for_field() -> None:
    described, engine_views = description(), views([decoding(), decoding()])
    (load,) = scheduler_loads(described, engine_views, [])
    record = engine_load(described, engine_views, [], None)
    assert record is not None
    for field, load_field in CORE.items():
        assert getattr(record, field) == getattr(load, load_field), field
    assert (record.running_requests, record.waiting_requests) == (3, 2)
    assert record.token_usage == pytest.approx(0.25)
    assert (record.max_total_num_tokens, record.num_used_tokens, record.max_running_requests) == (4096, 1024, 4)
    assert record.gen_throughput > 0
    # Queued token-work is reported (0 here), not left absent: absent means "cannot tell" to the gateway.
    assert record.HasField("waiting_uncached_tokens")
    assert not record.HasField("speculative")
    # The recorder's to set.
    assert (record.sample, record.load_only) == (0, False)


def test_before_the_first_step_rank_0_reports_zeros_and_a_rank_the_engine_lacks_none() -> None:
    described = description()
    record = engine_load(described, [], [], 0)
    assert record is not None
    assert (record.running_requests, record.token_usage, record.gen_throughput) == (0, 0.0, 0.0)
    assert record.max_total_num_tokens == 4096
    assert engine_load(described, [], [], 1) is None


def test_verified_drafts_in_the_window_fill_the_speculative_section() -> None:
    # 2 verify steps, 4 sequences × 3 drafts each: 24 drafted, 6 + 9 accepted.
    engine_views = views([verifying(accepted=6), verifying(accepted=9)], drafter=Drafter(K))
    (view,) = engine_views
    assert view.speculation is not None
    record = engine_load(description(), engine_views, [], 0)
    assert record is not None
    assert record.HasField("speculative")
    assert record.speculative.accept_rate == pytest.approx(15 / 24)
    assert record.speculative.accept_length == pytest.approx(1 + 15 / 8)  # vLLM's: 1 + accepted ÷ drafts
    assert record.speculative.accept_rate == pytest.approx(view.speculation.acceptance_rate)
    assert record.speculative.accept_length == pytest.approx(view.speculation.mean_acceptance_length)
    # The core is still GetLoads'.
    (load,) = scheduler_loads(description(), engine_views, [])
    for field, load_field in CORE.items():
        assert getattr(record, field) == getattr(load, load_field), field


def test_each_rank_carries_its_own_figures_and_only_a_speculating_rank_its_section() -> None:
    described = description(ranks=2)
    engine_views = views([decoding(engine=0, running=2), verifying(engine=1, sequences=4)], ranks=2, drafter=Drafter(K))
    first, second = engine_load(described, engine_views, [], 0), engine_load(described, engine_views, [], 1)
    assert first is not None
    assert second is not None
    assert (first.running_requests, second.running_requests) == (2, 4)
    assert not first.HasField("speculative")
    assert second.HasField("speculative")
    assert engine_load(described, engine_views, [], None) == first
    assert engine_load(described, engine_views, [], 2) is None


# The servicer: its KV-event stream carries the record (a real ZMQ publisher, the scripted engine behind it).


class PublishingEngine(ScriptedEngine):
    """The scripted engine, describing a KV-event publisher at `endpoint` as vLLM's --kv-events-config does."""

    def __init__(self, endpoint: str) -> None:
        super().__init__()
        self._description = dataclasses.replace(
            self._description, kv_event_publishers=(KvEventPublisher(rank=0, endpoint=endpoint),)
        )


@pytest.fixture
def publisher() -> Iterator[tuple[zmq.Socket[Any], str]]:
    context = zmq.Context()
    socket = context.socket(zmq.PUB)
    port = socket.bind_to_random_port("tcp://127.0.0.1")
    try:
        yield socket, f"tcp://127.0.0.1:{port}"
    finally:
        socket.close(linger=0)
        context.term()


async def test_the_kv_event_stream_carries_the_load_and_a_heartbeat_while_idle(
    publisher: tuple[zmq.Socket[Any], str],
) -> None:
    socket, endpoint = publisher
    async with served(PublishingEngine(endpoint)) as s:
        s.steps.record(decoding(running=3, waiting=2, usage=0.25))
        call = s.stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest())
        await call.initial_metadata()  # subscribed
        batches: list[common_pb2.KvEventBatch] = []

        async def read() -> None:
            async for batch in call:
                batches.append(batch)
                if batch.load.load_only:
                    return

        reader = asyncio.create_task(read())
        # A publisher's batch, as vLLM sends it: [topic, sequence, [ts, events, rank]]; republished until the
        # subscription (ZMQ's slow joiner) sees one.
        sequence = 0
        while not batches and not reader.done():
            sequence += 1
            payload = msgspec.msgpack.encode([time.time(), [], 0])
            socket.send_multipart([b"", sequence.to_bytes(8, "big"), payload])
            await asyncio.sleep(0.05)
        await asyncio.wait_for(reader, timeout=10)
        call.cancel()
        loads = await s.stub.GetLoads(pb.GetLoadsRequest())
    (load,) = loads.loads
    event_batch, heartbeat = batches[0], batches[-1]
    assert event_batch.HasField("load")
    assert not event_batch.load.load_only
    assert (event_batch.load.running_requests, event_batch.load.waiting_requests) == (3, 2)
    assert event_batch.load.token_usage == pytest.approx(0.25)
    # The heartbeat repeats the last sequence and carries GetLoads' figures, telemetry included (all but the
    # measured throughput, which falls as the window grows between the two reads).
    assert heartbeat.load.load_only
    assert heartbeat.sequence_number == batches[-2].sequence_number
    for field, load_field in CORE.items():
        if field != "gen_throughput":
            assert getattr(heartbeat.load, field) == getattr(load, load_field), field
    assert heartbeat.load.gen_throughput > 0
    assert not heartbeat.load.HasField("speculative")
