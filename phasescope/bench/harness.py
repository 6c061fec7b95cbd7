"""Running a server for a measurement or a test: the one process harness of the benchmarks and the tests.

A managed process runs in its own process group with its output in a log file;
stopping it ends the whole group, so a `phasescope serve` takes its engine-core
processes with it. A start that fails (the process exits, or is not ready in
time) stops the group before the error is raised: nothing outlives it.
`write_results` writes what a run measured the way docs/data keeps it.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

import grpc

from phasescope.client.client import Client
from phasescope.telemetry.exposition import Samples, fetch_samples, sum_samples


def write_results(path: Path, data: object, *, indent: int | None = 1) -> None:
    """`data` as JSON in `path`, its folders made; gzip-compressed when the name ends in `.gz`.

    Compressed as `gzip -9 -n` does (docs/data/README.md): no file name and time 0 in the header, so the
    same data makes the same bytes and a committed result only changes when its data does.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    text = (json.dumps(data, indent=indent) + "\n").encode()
    # gzip.compress writes no file name, and the same header as `gzip -9 -n` (GzipFile marks the OS unknown).
    path.write_bytes(gzip.compress(text, compresslevel=9, mtime=0) if path.suffix == ".gz" else text)


class StartError(RuntimeError):
    """A managed process exited, or was not ready in time, during start-up."""


def stop_on_sigterm() -> None:
    """SIGTERM ends a tool as Ctrl-C does: KeyboardInterrupt in the main thread, so every `with`, exit stack
    and `finally` that stops a server or an engine runs. The default would end the process at once and leave
    the servers it started (each in its own process group) and its in-process engine running."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)


# Linux's default ephemeral range, where the kernel puts the local end of every outgoing connection.
_EPHEMERAL_PORTS = (32768, 60999)
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range of ports for the local ends of outgoing connections (Linux's default elsewhere)."""
    with contextlib.suppress(OSError, ValueError):
        low, high = (int(value) for value in _RANGE_FILE.read_text().split())
        return low, high
    return _EPHEMERAL_PORTS


def free_port() -> int:
    """A loopback port free now, below the kernel's ephemeral range. A port the kernel hands out
    (bind to 0) is an ephemeral one, which any outgoing connection (a client's, a gateway's) can take
    as its local end before the server it was meant for binds it: vLLM's gRPC worker binds only after
    loading its model, a minute later, and then failed with "Failed to bind"."""
    low, _ = ephemeral_ports()
    chooser = random.SystemRandom()  # two harnesses on one machine do not walk the same sequence
    for _ in range(200):
        port = chooser.randrange(max(1024, low - 12000), low)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as probe:  # every port below the range is taken: the kernel's choice, as before
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def listening(port: int) -> bool:
    """Whether something accepts connections on the loopback port."""
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


class ManagedProcess:
    """A process in its own process group, its stdout and stderr in `log_path`."""

    def __init__(
        self,
        command: Sequence[str],
        log_path: Path,
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.log_path = log_path
        self._log = log_path.open("wb")
        self._stopped = False
        self._terminated = False
        self.process = subprocess.Popen(
            command,
            cwd=cwd,
            env={**os.environ, **(env or {})},
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            # Its own process group (stop() signals the whole group), but not its own session: with the
            # kernel's autogroup scheduling (on by default on desktops and VMs) a new session is a new
            # scheduling group, which gets as much CPU as the whole caller, whatever the caller runs.
            # A server and its spinning engine in their own group against the benchmark's client stalled
            # whole streams (docs/benchmarks.md, "How to compare: one command, alternating rounds, intervals").
            process_group=0,
        )

    def wait_until(
        self, ready: Callable[[], bool], what: str, *, timeout: float = 600.0, poll_seconds: float = 1.0
    ) -> None:
        """Poll `ready` (an exception counts as not ready) until it holds; stop the group and raise if it never does."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.stop()
                raise StartError(f"{what} exited with {self.process.returncode}; see {self.log_path}")
            with contextlib.suppress(Exception):
                if ready():
                    return
            time.sleep(poll_seconds)
        self.stop()
        raise StartError(f"{what} not ready after {timeout:.0f} s; see {self.log_path}")

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def terminate(self) -> None:
        """SIGTERM now, once (a server starts to drain), without waiting: `stop` then waits for it. Stopping
        several processes, terminate each first and they shut down side by side."""
        if not self._terminated and not self._stopped and self.process.poll() is None:
            self._terminated = True
            self.process.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 90.0) -> int:
        """SIGTERM (a server drains; not again after `terminate`), then SIGKILL the whole process group if it does
        not exit in time.

        Safe to call again: the group is signalled once, never after its id may have been reused.
        """
        if self._stopped:
            return int(self.process.returncode)
        self.terminate()
        self._stopped = True
        if self.process.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=timeout)
        # The group holds the processes this one spawned (a server's engine cores).
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self._log.close()
        return int(self.process.returncode)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()


def health_status(address: str, service: str = "", timeout_seconds: float = 2.0) -> str:
    """The standard health service's answer over plaintext gRPC, or UNREACHABLE when nothing listens yet."""
    try:
        with Client(address, timeout_seconds=timeout_seconds) as client:
            return client.health(service)
    except grpc.RpcError as exc:
        return "UNREACHABLE" if exc.code() is grpc.StatusCode.UNAVAILABLE else exc.code().name


def wait_engine_idle(metrics_url: str, timeout: float = 20.0, poll_seconds: float = 0.05) -> dict[str, float]:
    """Poll /metrics until the engine runs and queues nothing and no request is in flight; returns the last state."""
    deadline = time.monotonic() + timeout
    state: dict[str, float] = {}
    while time.monotonic() < deadline:
        samples = fetch_samples(metrics_url)
        state = {
            "running": sum_samples(samples, "phasescope_engine_requests", state="running"),
            "waiting": sum_samples(samples, "phasescope_engine_requests", state="waiting"),
            "in_flight": sum_samples(samples, "phasescope_requests_in_flight"),
        }
        if not any(state.values()):
            break
        time.sleep(poll_seconds)
    return state


class PhasescopeProcess(ManagedProcess):
    """`python -m phasescope serve` on free loopback ports (gRPC and /metrics), then `serve_args`."""

    def __init__(
        self,
        serve_args: Sequence[str],
        log_path: Path,
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.port = free_port()
        self.metrics_port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        # Each distinct health answer seen while waiting, in order (UNREACHABLE, NOT_SERVING, SERVING).
        self.health_history: list[str] = []
        command = [sys.executable, "-m", "phasescope", "serve", "--port", str(self.port),
                   "--metrics-port", str(self.metrics_port), *serve_args]  # fmt: skip
        super().__init__(command, log_path, env=env, cwd=cwd)

    def health(self, service: str = "") -> str:
        return health_status(self.address, service)

    def wait_serving(self, timeout: float = 600.0) -> None:
        """Until health says SERVING; StartError (the group stopped) if the server exits or the time runs out."""

        def serving() -> bool:
            status = self.health()
            if not self.health_history or self.health_history[-1] != status:
                self.health_history.append(status)
            return status == "SERVING"

        self.wait_until(serving, "phasescope", timeout=timeout, poll_seconds=0.2)

    def samples(self) -> Samples:
        """Every sample on /metrics, keyed by name and labels."""
        return fetch_samples(self.metrics_url)

    def wait_engine_idle(self, timeout: float = 20.0) -> dict[str, float]:
        """Poll until the engine runs and queues nothing and no request is in flight; returns the last state."""
        return wait_engine_idle(self.metrics_url, timeout)


class GatewayProcess(ManagedProcess):
    """The smg gateway (`smg launch`) on a free loopback port, in front of gRPC workers: OpenAI HTTP to
    its clients, vLLM's engine protocol to each worker."""

    def __init__(
        self,
        worker_addresses: Sequence[str],
        tokenizer_path: Path,
        log_path: Path,
        *,
        policy: str = "round_robin",
        extra_args: Sequence[str] = (),
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # Its own metrics on a free port too: the default (29000) is taken by a second gateway on the machine.
        self.metrics_port = free_port()
        self.ready_at = 0.0
        """`time.monotonic()` when a worker had registered (the gateway pings it from then on)."""
        # The launcher installed beside this interpreter (the serving environment's `smg`).
        launcher = Path(sys.executable).with_name("smg")
        # Stopped once its callers are done, with no load balancer in front: smg's default grace keeps the listener
        # open 5 s after a SIGTERM for one to notice; 1 s lets it exit in half a second.
        command = [str(launcher), "launch", "--host", "127.0.0.1", "--port", str(self.port),
                   "--worker-urls", *(f"grpc://{address}" for address in worker_addresses),
                   "--tokenizer-path", str(tokenizer_path), "--policy", policy, "--prometheus-host", "127.0.0.1",
                   "--prometheus-port", str(self.metrics_port), "--shutdown-grace-period-secs", "1",
                   *extra_args]  # fmt: skip
        super().__init__(command, log_path)

    def models(self) -> list[str]:
        """The models the gateway serves (its workers registered): /v1/models."""
        with urllib.request.urlopen(f"{self.url}/v1/models", timeout=5) as response:
            return [model["id"] for model in json.loads(response.read())["data"]]

    def tokenizers(self) -> list[str]:
        """The names of the tokenizers the gateway holds (/v1/tokenizers): a registered worker's model gets one
        named after it, beside the one --tokenizer-path loads under its path."""
        with urllib.request.urlopen(f"{self.url}/v1/tokenizers", timeout=5) as response:
            return [tokenizer["name"] for tokenizer in json.loads(response.read())["tokenizers"]]

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Until a worker registered (health, model info and server info answered) and each model the gateway
        lists has its tokenizer: smg lists a model a few tens of milliseconds before its tokenizer is registered,
        and answers 503 (tokenizer_not_ready) to requests for it in between."""

        def ready() -> bool:
            models = self.models()
            return bool(models) and set(models) <= set(self.tokenizers())

        self.wait_until(ready, "smg gateway", timeout=timeout, poll_seconds=0.1)
        self.ready_at = time.monotonic()
