"""Fixtures for integration tests: the real engine behind real servers.

The default server starts once per session; modules that must stop or break a
server (drain, engine death) start their own through `start_server`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from phasescope.client.client import Client
from phasescope.engine.default_model import ensure_default_model
from support.otlp import OtlpReceiver
from support.servers import ServerProcess


@pytest.fixture(scope="session")
def default_model() -> Path:
    """Prepared once per machine (cached), before any server starts, so start-up timeouts stay honest."""
    return ensure_default_model()


@pytest.fixture(scope="session")
def start_server(
    default_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., ServerProcess]]:
    started: list[ServerProcess] = []

    def start(*extra_args: str, wait: bool = True, env: dict[str, str] | None = None) -> ServerProcess:
        log = tmp_path_factory.mktemp("server") / "serve.log"
        server = ServerProcess(log, tuple(extra_args), env)
        started.append(server)
        if wait:
            server.wait_serving()
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def otlp_receiver() -> Iterator[OtlpReceiver]:
    receiver = OtlpReceiver()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="session")
def server(start_server: Callable[..., ServerProcess], otlp_receiver: OtlpReceiver) -> ServerProcess:
    """The shared server traces every request to a real OTLP receiver run by the tests."""
    return start_server(
        "--otlp-endpoint",
        f"http://127.0.0.1:{otlp_receiver.port}",
        # Export batches every 100 ms instead of every 5 s, so tests see spans quickly.
        env={"OTEL_BSP_SCHEDULE_DELAY": "100"},
    )


@pytest.fixture
def client(server: ServerProcess) -> Iterator[Client]:
    with server.client() as c:
        yield c
