"""Health through start-up, overload refusal, and SIGTERM draining, on a server of this module's own."""

from __future__ import annotations

import ctypes.util
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import psutil
import pytest

from phasescope.client.client import build_request
from phasescope.v1 import inference_pb2 as pb
from support.servers import ServerProcess, assert_front_end_off_the_workers_cpus

LONG = build_request(prompt="Tell me everything about the sea.", max_tokens=400, ignore_eos=True)


@pytest.fixture(scope="module")
def small_server(start_server: Callable[..., ServerProcess]) -> ServerProcess:
    # One running slot and one waiting slot: the third concurrent request is refused.
    # It also keeps its front end off the engine worker's CPUs (--pin-front-end), which nothing here may notice.
    server = start_server(
        "--max-concurrent-requests", "1", "--max-queued-requests", "1", "--pin-front-end", wait=False
    )  # fmt: skip
    server.wait_serving()
    return server


class Stream:
    """A streaming call read on a thread, so a test can act while it runs."""

    def __init__(self, server: ServerProcess, request: pb.GenerateRequest) -> None:
        self.chunks: list[pb.GenerateStreamResponse] = []
        self.error: grpc.RpcError | None = None
        self.first_chunk = threading.Event()
        self._client = server.client()
        self._call: Iterator[pb.GenerateStreamResponse] = self._client.generate_stream(request)
        self._thread = threading.Thread(target=self._read)
        self._thread.start()

    def _read(self) -> None:
        try:
            for chunk in self._call:
                self.chunks.append(chunk)
                self.first_chunk.set()
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            self.first_chunk.set()

    def cancel(self) -> None:
        self._call.cancel()  # type: ignore[attr-defined]  # the call object is also a grpc.Future

    def join(self, timeout: float = 120) -> None:
        self._thread.join(timeout)
        self._client.close()


def test_health_is_not_serving_until_the_engine_is_warm(small_server: ServerProcess) -> None:
    # The gRPC port opens before the engine loads; health must say so.
    # A probe that found nothing listening yet, or got no answer in time on a busy machine, says nothing.
    seen = [status for status in small_server.health_history if status not in ("UNREACHABLE", "DEADLINE_EXCEEDED")]
    assert seen == ["NOT_SERVING", "SERVING"]
    assert small_server.health("phasescope.v1.Inference") == "SERVING"


def test_requests_beyond_capacity_are_resource_exhausted(small_server: ServerProcess) -> None:
    before = small_server.sample_sum("phasescope_requests_rejected_total", reason="overloaded")
    running = Stream(small_server, LONG)
    assert running.first_chunk.wait(60)
    waiting = Stream(small_server, build_request(prompt="Wait your turn.", max_tokens=4, ignore_eos=True))
    deadline = time.monotonic() + 30
    while small_server.sample_sum("phasescope_requests_in_flight") < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        with small_server.client() as client, pytest.raises(grpc.RpcError) as caught:
            client.generate(build_request(prompt="One too many.", max_tokens=4))
        assert caught.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "capacity" in (caught.value.details() or "")
        assert small_server.sample_sum("phasescope_requests_rejected_total", reason="overloaded") == before + 1
    finally:
        running.cancel()
        running.join()
        waiting.join()
    # The waiting request was admitted and served once the slot freed.
    assert waiting.error is None
    assert waiting.chunks[-1].usage.completion_tokens == 4
    # Capacity is back.
    with small_server.client() as client:
        assert client.generate(build_request(prompt="Now?", max_tokens=2, ignore_eos=True)).usage.completion_tokens == 2


def test_offered_load_far_beyond_capacity_is_shed_and_admitted_work_completes(small_server: ServerProcess) -> None:
    # Capacity is 2 (one running, one waiting); offer 12 at once, three times over.
    rejected_before = small_server.sample_sum("phasescope_requests_rejected_total", reason="overloaded")
    rss_before = psutil.Process(small_server.process.pid).memory_info().rss
    outcomes: list[str] = []
    timings: list[pb.Timings] = []
    lock = threading.Lock()

    def offer(index: int, arrive: threading.Barrier) -> None:
        with small_server.client() as client:
            # Connect first, so the whole burst reaches the server at once, however slow the machine.
            client.model_info()
            arrive.wait(60)
            try:
                response = client.generate(build_request(prompt=f"Load {index}:", max_tokens=6, ignore_eos=True))
                result = f"ok:{response.usage.completion_tokens}"
                with lock:
                    timings.append(response.timings)
            except grpc.RpcError as exc:
                result = exc.code().name
        with lock:
            outcomes.append(result)

    for _ in range(3):
        arrive = threading.Barrier(12)
        threads = [threading.Thread(target=offer, args=(i, arrive)) for i in range(12)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    admitted = [o for o in outcomes if o.startswith("ok:")]
    refused = [o for o in outcomes if o == "RESOURCE_EXHAUSTED"]
    # Everything is either served in full or refused as overload: nothing else.
    assert len(admitted) + len(refused) == 36
    assert all(o == "ok:6" for o in admitted)
    assert len(refused) >= 3 * (12 - 2) - 6  # a few slots free up while a burst is still arriving
    assert small_server.sample_sum("phasescope_requests_rejected_total", reason="overloaded") - rejected_before == len(
        refused
    )
    # Admitted latency stays bounded however much is offered: with one running and one
    # waiting slot, no admitted request queues longer than about one request's service time.
    service = sorted(t.prefill_seconds + t.decode_seconds for t in timings)
    assert max(t.queue_seconds for t in timings) <= 3 * service[-1]
    # Refusing the excess keeps the process's memory flat.
    assert psutil.Process(small_server.process.pid).memory_info().rss - rss_before < 200 * 2**20
    # Once the load drops it serves normally.
    with small_server.client() as client:
        assert (
            client.generate(build_request(prompt="Calm:", max_tokens=2, ignore_eos=True)).usage.completion_tokens == 2
        )


def test_a_pinned_front_end_leaves_the_engine_workers_cpus_to_them(small_server: ServerProcess) -> None:
    assert_front_end_off_the_workers_cpus(small_server)


def test_sigterm_drains_in_flight_requests_then_stops(small_server: ServerProcess) -> None:
    in_flight = Stream(small_server, build_request(prompt="A long answer please.", max_tokens=60, ignore_eos=True))
    assert in_flight.first_chunk.wait(60)
    small_server.process.terminate()
    deadline = time.monotonic() + 10
    while small_server.health() == "SERVING" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert small_server.health() == "NOT_SERVING"
    with small_server.client() as client, pytest.raises(grpc.RpcError) as caught:
        client.generate(build_request(prompt="Too late.", max_tokens=2))
    assert caught.value.code() is grpc.StatusCode.UNAVAILABLE
    in_flight.join()
    # The request in flight at SIGTERM ran to its end inside the grace period.
    assert in_flight.error is None
    assert in_flight.chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert in_flight.chunks[-1].usage.completion_tokens == 60
    assert small_server.process.wait(timeout=60) == 0


def test_the_server_and_its_engine_processes_run_on_tcmalloc(server: ServerProcess) -> None:
    # make setup installs Debian's libtcmalloc-minimal4; phasescope serve re-executes itself with it preloaded.
    assert ctypes.util.find_library("tcmalloc_minimal"), "libtcmalloc-minimal4 is not installed: run make setup"
    front = psutil.Process(server.process.pid)
    processes = [front, *front.children(recursive=True)]
    assert len(processes) >= 2  # the front end and at least its engine core
    for process in processes:
        assert any("libtcmalloc" in region.path for region in process.memory_maps()), process.name()
    # vLLM's CPU worker warns when tcmalloc is missing; it has nothing to warn about.
    assert "libtcmalloc is not found" not in server.log_path.read_text(errors="replace")
