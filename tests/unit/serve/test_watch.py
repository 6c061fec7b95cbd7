"""WatchTelemetry without vLLM: the real servicer, gRPC server and client, a scripted engine and real StepMetrics."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager

import grpc
import pytest

from phasescope.client.client import build_request
from phasescope.telemetry.step.records import StepRecord, StepReport
from phasescope.v1 import inference_pb2 as pb
from support.fake_engine import Script, ScriptedEngine
from support.served import MODEL, Served, served


def watched(engine: ScriptedEngine, max_watchers: int = 4) -> AbstractAsyncContextManager[Served]:
    return served(engine, max_watchers=max_watchers, max_queued_requests=4, metrics_window_seconds=5.0)


async def test_snapshots_carry_the_engine_figures_and_a_request_moving_from_prefill_to_decode() -> None:
    # The first step (the prefill) takes 0.6 s, then a token every 0.1 s.
    engine = ScriptedEngine(lambda prompt: Script(tokens=list(range(100, 120)), step_seconds=0.1, queue_seconds=0.5))

    async def scenario() -> list[pb.TelemetrySnapshot]:
        async with watched(engine) as s:
            s.steps.record(StepReport(step=StepRecord(0, 0, 0, 1, 1, 0.05, flops=2e6, read_bytes=4e6)))
            stream = s.client.generate_stream(build_request(prompt="hello", max_tokens=20, request_id="r-1"))
            consume = asyncio.create_task(_drain(stream))
            snapshots = []
            async for snapshot in s.client.watch_telemetry(pb.WatchTelemetryRequest(interval_seconds=0.25)):
                snapshots.append(snapshot)
                if any(r.phase == "decode" for r in snapshot.requests) or len(snapshots) > 40:
                    break
            await consume
            return snapshots

    snapshots = await scenario()
    first, last = snapshots[0], snapshots[-1]
    assert first.model_name == MODEL
    assert (first.peaks.memory_bandwidth_bytes_per_second, first.peaks.flops_per_second) == (100e9, 1e12)
    assert first.peaks.ridge_point_flops_per_byte == 10
    assert [phase.phase for phase in first.engines[0].phases] == ["prefill", "decode"]
    # The step recorded before the watch: decode ran, prefill did not.
    decode = first.engines[0].phases[1]
    assert decode.ran
    assert decode.verdict in {"memory", "compute", "host", "idle"}
    assert not first.engines[0].phases[0].ran
    assert first.engines[0].headroom_limit in {"bandwidth", "compute", "kv_cache", "queue"}
    phases = [r.phase for s in snapshots for r in s.requests if r.request_id == "r-1"]
    # Waiting for its first token, then decoding: never text, just the figures.
    assert phases[0] == "prefill"
    assert phases[-1] == "decode"
    (request,) = last.requests
    assert request.prompt_tokens > 0
    assert request.completion_tokens >= 1
    assert last.requests_in_flight == 1
    assert last.admission.in_flight == 1
    assert last.admission.capacity == 8


async def _drain(stream: AsyncIterator[pb.GenerateStreamResponse]) -> None:
    async for _ in stream:
        pass


@pytest.mark.parametrize(
    ("options", "field"),
    [
        (pb.WatchTelemetryRequest(interval_seconds=0.1), "interval_seconds"),
        (pb.WatchTelemetryRequest(interval_seconds=61), "interval_seconds"),
        (pb.WatchTelemetryRequest(max_requests=1001), "max_requests"),
    ],
)
async def test_options_out_of_range_are_refused_naming_the_field(options: pb.WatchTelemetryRequest, field: str) -> None:
    async def scenario() -> grpc.aio.AioRpcError:
        async with watched(ScriptedEngine()) as s:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in s.client.watch_telemetry(options):
                    pass
            return caught.value

    error = await scenario()
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert (error.details() or "").startswith(f"{field}:")


async def test_the_watcher_cap_is_enforced_and_a_closed_watcher_frees_its_place() -> None:
    async def scenario() -> tuple[grpc.aio.AioRpcError, pb.TelemetrySnapshot]:
        async with watched(ScriptedEngine(), max_watchers=1) as s:
            first = s.client.watch_telemetry(pb.WatchTelemetryRequest(interval_seconds=0.25))
            await first.__anext__()
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in s.client.watch_telemetry():
                    pass
            await first.aclose()  # type: ignore[attr-defined]  # an async generator
            # The server notices the cancel at its next tick.
            deadline = time.monotonic() + 5
            while s.built.inference.watchers:
                assert time.monotonic() < deadline, "the closed watcher was never released"
                await asyncio.sleep(0.05)
            again = s.client.watch_telemetry(pb.WatchTelemetryRequest(omit_requests=True))
            snapshot = await again.__anext__()
            await again.aclose()  # type: ignore[attr-defined]
            return caught.value, snapshot

    error, snapshot = await scenario()
    assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-watchers 1" in (error.details() or "")
    assert snapshot.model_name == MODEL
    assert not snapshot.requests


async def test_a_long_wait_skips_ticks_instead_of_queueing_snapshots() -> None:
    async def scenario() -> list[float]:
        async with watched(ScriptedEngine()) as s:
            stamps = []
            stream = s.client.watch_telemetry(pb.WatchTelemetryRequest(interval_seconds=0.25))
            async for snapshot in stream:
                stamps.append(snapshot.time_unix_seconds)
                if len(stamps) == 4:
                    break
            return stamps

    stamps = await scenario()
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    # On the watcher's own grid: a quarter of a second apart, not as fast as the client reads.
    assert all(gap > 0.2 for gap in gaps)
