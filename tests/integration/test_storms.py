"""Cancellation storms, expiring deadlines and a client that stops reading: the engine is freed every time."""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import psutil

from phasescope.client.client import build_request
from support.servers import ServerProcess


def rss_bytes(server: ServerProcess) -> int:
    return int(psutil.Process(server.process.pid).memory_info().rss)


def test_storm_of_cancelled_streams_and_expired_deadlines_leaves_nothing_behind(server: ServerProcess) -> None:
    rss_before = rss_bytes(server)
    rng = random.Random(7)
    plans = [("cancel", rng.randint(0, 6)) for _ in range(160)] + [
        ("deadline", rng.uniform(0.2, 1.5)) for _ in range(40)
    ]
    rng.shuffle(plans)
    outcomes: list[str] = []
    lock = threading.Lock()

    def one(plan: tuple[str, float]) -> None:
        kind, value = plan
        request = build_request(prompt=f"Storm {rng.random()}:", max_tokens=600, ignore_eos=True)
        timeout = value if kind == "deadline" else 120
        with server.client(timeout_seconds=timeout) as client:
            stream = client.generate_stream(request)
            try:
                for index, _ in enumerate(stream):
                    if kind == "cancel" and index >= value:
                        stream.cancel()  # type: ignore[attr-defined]  # the call object is also a grpc.Future
                        break
                result = "cancelled" if kind == "cancel" else "finished"
            except grpc.RpcError as exc:
                result = exc.code().name
        with lock:
            outcomes.append(result)

    with ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(one, plans))
    assert len(outcomes) == 200
    # Deadlines mid-decode end as DEADLINE_EXCEEDED; nothing ends as an internal error.
    assert "INTERNAL" not in outcomes
    assert outcomes.count("DEADLINE_EXCEEDED") >= 30
    assert server.wait_engine_idle() == {"running": 0, "waiting": 0, "in_flight": 0}
    # Memory comes back near where it was: no per-request leak (200 requests would show).
    assert rss_bytes(server) - rss_before < 300 * 2**20
    with server.client() as client:
        assert (
            client.generate(build_request(prompt="Still here?", max_tokens=3, ignore_eos=True)).usage.completion_tokens
            == 3
        )


def test_a_client_that_stops_reading_does_not_block_others(server: ServerProcess) -> None:
    with server.client(timeout_seconds=300) as stalled_client:
        stalled = stalled_client.generate_stream(build_request(prompt="Never read:", max_tokens=1500, ignore_eos=True))
        next(stalled)  # the stream is live; from here on nobody reads it
        # Blocked requests would run into the client's deadline and fail here.
        with server.client(timeout_seconds=120) as client:
            for index in range(4):
                response = client.generate(build_request(prompt=f"Meanwhile {index}:", max_tokens=8, ignore_eos=True))
                assert response.usage.completion_tokens == 8
        stalled.cancel()  # type: ignore[attr-defined]  # the call object is also a grpc.Future
    assert server.wait_engine_idle() == {"running": 0, "waiting": 0, "in_flight": 0}
