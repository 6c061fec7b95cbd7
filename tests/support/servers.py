"""Real `phasescope serve` processes for integration tests, on free ports, with real vLLM inside.

Every server runs in its own process group so that stopping it also ends its
engine-core processes, even when a test fails.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from server.client import PhasescopeClient
from telemetry.exposition import Samples, parse_samples, sum_samples

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_SECONDS = 300.0
# The settings every test server shares: small context and KV cache, no graph capture.
BASE_ARGS = (
    "--enforce-eager", "--kv-cache-gib", "1", "--max-model-len", "2048", "--shutdown-grace-seconds", "30",
    # A short window keeps the roofline tests quick.
    "--metrics-window-seconds", "5",
)  # fmt: skip
WINDOW_SECONDS = 5.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class ServerProcess:
    """One `phasescope serve` process and what a test needs to talk to it."""

    def __init__(self, log_path: Path, extra_args: tuple[str, ...], extra_env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.metrics_port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log_path = log_path
        self.health_history: list[str] = []
        env = dict(os.environ, PYTHONUNBUFFERED="1", **(extra_env or {}))
        self._log = log_path.open("wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "server", "serve", *BASE_ARGS,
             "--port", str(self.port), "--metrics-port", str(self.metrics_port), *extra_args],
            cwd=ROOT,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip

    def health(self, service: str = "") -> str:
        """The health service's answer, or UNREACHABLE when nothing listens yet."""
        with grpc.insecure_channel(self.address) as channel:
            try:
                response = health_pb2_grpc.HealthStub(channel).Check(  # type: ignore[attr-defined]  # stubs lack Check
                    health_pb2.HealthCheckRequest(service=service), timeout=2
                )
            except grpc.RpcError as exc:
                return "UNREACHABLE" if exc.code() is grpc.StatusCode.UNAVAILABLE else exc.code().name
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))

    def wait_serving(self, timeout: float = START_TIMEOUT_SECONDS) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode} during start-up:\n{self.log_tail()}")
            status = self.health()
            if not self.health_history or self.health_history[-1] != status:
                self.health_history.append(status)
            if status == "SERVING":
                return
            time.sleep(0.2)
        raise TimeoutError(f"server not SERVING after {timeout} s:\n{self.log_tail()}")

    def client(self, timeout_seconds: float | None = 120) -> PhasescopeClient:
        return PhasescopeClient(self.address, timeout_seconds=timeout_seconds)

    def metrics_text(self, openmetrics: bool = False) -> str:
        request = urllib.request.Request(f"http://127.0.0.1:{self.metrics_port}/metrics")
        if openmetrics:
            request.add_header("Accept", "application/openmetrics-text; version=1.0.0")
        with urllib.request.urlopen(request, timeout=10) as response:
            return str(response.read().decode())

    def samples(self) -> Samples:
        """Every sample on /metrics, keyed by name and labels."""
        return parse_samples(self.metrics_text())

    def sample_sum(self, name: str, **labels: str) -> float:
        """Sum of a series over every label set that includes `labels`."""
        return sum_samples(self.samples(), name, **labels)

    def wait_engine_idle(self, timeout: float = 20.0) -> dict[str, float]:
        """Poll until the engine runs and queues nothing and no request is in flight; returns the last state."""
        deadline = time.monotonic() + timeout
        state: dict[str, float] = {}
        while time.monotonic() < deadline:
            samples = self.samples()
            state = {
                "running": sum_samples(samples, "phasescope_engine_requests", state="running"),
                "waiting": sum_samples(samples, "phasescope_engine_requests", state="waiting"),
                "in_flight": sum_samples(samples, "phasescope_requests_in_flight"),
            }
            if not any(state.values()):
                break
            time.sleep(0.05)
        return state

    def log_tail(self, lines: int = 60) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout: float = 90.0) -> int:
        """SIGTERM (drain), then SIGKILL the whole process group if it does not exit in time."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=timeout)
        # The group holds the engine-core processes this server spawned.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self._log.close()
        return int(self.process.returncode)
