"""WatchTelemetry on the real engine: snapshots at the interval, a request moving through its phases,
the same figures as /metrics, a watcher that stops reading, and the watcher cap."""

from __future__ import annotations

import itertools
import random

import grpc
import pytest

from phasescope.client.client import build_request
from phasescope.telemetry.exposition import sum_samples
from phasescope.v1 import inference_pb2 as pb
from support.servers import ServerProcess

IDLE = {"running": 0, "waiting": 0, "in_flight": 0}


def test_snapshots_follow_a_stream_from_prefill_to_decode_and_agree_with_metrics(server: ServerProcess) -> None:
    assert server.wait_engine_idle() == IDLE
    prompt = [random.Random(7).randrange(1_000, 40_000) for _ in range(600)]
    with server.client() as client, server.client() as watcher:
        snapshots = watcher.watch_telemetry(pb.WatchTelemetryRequest(interval_seconds=0.5))
        received = [next(snapshots)]
        # A 600-token prompt the prefix cache has never seen: its prefill spans several snapshots on a CPU.
        stream = client.generate_stream(
            build_request(token_ids=prompt, max_tokens=200, ignore_eos=True, request_id="watched-1")
        )
        phases: list[str] = []
        try:
            for snapshot in snapshots:
                received.append(snapshot)
                phases += [r.phase for r in snapshot.requests if r.request_id == "watched-1"]
                if "decode" in phases and len(received) >= 6:
                    # The same moment, from both sides: a snapshot, then a scrape.
                    metrics = server.samples()
                    break
                assert len(received) < 120, "the stream never reached decode"
        finally:
            snapshots.cancel()  # type: ignore[attr-defined]  # the call object is also a grpc.Future
            stream.cancel()  # type: ignore[attr-defined]
    # At the interval: consecutive snapshots half a second apart on the server's clock.
    gaps = [b.time_unix_seconds - a.time_unix_seconds for a, b in itertools.pairwise(received)]
    assert all(0.4 < gap < 1.5 for gap in gaps), gaps
    # The request is seen waiting for its first token, then decoding.
    assert phases[0] == "prefill"
    assert phases[-1] == "decode"
    last = received[-1]
    (engine,) = last.engines
    decode = engine.phases[1]
    assert decode.phase == "decode"
    assert decode.ran
    # What /metrics says at the same moment: the same peaks exactly, the same verdict and
    # headroom limit, and the decode rate of the same window (a step apart at most).
    assert last.peaks.memory_bandwidth_bytes_per_second == sum_samples(
        metrics, "phasescope_hardware_peak_memory_bandwidth_bytes_per_second"
    )
    assert last.peaks.flops_per_second == sum_samples(metrics, "phasescope_hardware_peak_flops_per_second")
    verdicts = [dict(labels)["verdict"] for (name, labels), value in metrics.items()
                if name == "phasescope_bound" and ("phase", "decode") in labels and value == 1]  # fmt: skip
    assert verdicts == [decode.verdict]
    limits = [dict(labels)["limit"] for name, labels in metrics if name == "phasescope_headroom_ratio"]
    assert limits == [engine.headroom_limit]
    assert decode.tokens_per_second == pytest.approx(
        sum_samples(metrics, "phasescope_tokens_per_second", phase="decode"), rel=0.25
    )
    assert last.requests_in_flight == 1
    # The KV cache as /metrics has it: the engine's capacity, and the one sequence's tokens in use.
    assert engine.kv_cache_capacity_tokens == sum_samples(metrics, "phasescope_kv_cache_capacity_tokens") > 0
    assert engine.kv_cache_tokens > 0
    assert engine.kv_cache_sequences_fit > 1
    assert server.wait_engine_idle(timeout=60) == IDLE


def test_a_watcher_that_stops_reading_does_not_hold_up_a_stream_and_the_cap_holds(server: ServerProcess) -> None:
    assert server.wait_engine_idle() == IDLE
    clients = [server.client(timeout_seconds=None) for _ in range(5)]
    watches = []
    try:
        # Four watchers at the fastest interval that never read past their first snapshot (the cap is 4).
        for client in clients[:4]:
            watch = client.watch_telemetry(pb.WatchTelemetryRequest(interval_seconds=0.25))
            next(watch)
            watches.append(watch)
        with pytest.raises(grpc.RpcError) as caught:
            next(clients[4].watch_telemetry())
        assert caught.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-watchers 4" in (caught.value.details() or "")
        # A stream runs to its end beside them.
        with server.client() as client:
            response = client.generate(build_request(prompt="Count:", max_tokens=32, ignore_eos=True))
        assert response.usage.completion_tokens == 32
    finally:
        for watch in watches:
            watch.cancel()  # type: ignore[attr-defined]
        for client in clients:
            client.close()
    assert server.wait_engine_idle(timeout=60) == IDLE
