"""Fixtures for integration tests: the real engine behind real servers.

The default server starts once per session; modules that need other flags, or must stop or
break a server (drain, engine death), start their own through `start_server`, and each is
stopped when its module ends.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from phasescope.client.client import Client
from phasescope.engine.default_model import ensure_default_model
from support.otlp import OtlpReceiver
from support.servers import SHARED_CONTEXT, ServerProcess

# The modules that take longest, longest first (from `--durations`): with two workers each taking the next module
# as it finishes one (scripts/check.sh), the long ones start early and the short ones fill in around them.
LONGEST_FIRST = (
    "test_engine_survives", "test_gateway", "test_disaggregation", "test_loadtests", "test_speculative",
    "test_engine_side_telemetry", "test_data_parallel", "test_capacity", "test_lifecycle",
    "test_telemetry_under_load", "test_kv_transfer", "test_adapters", "test_access_control",
)  # fmt: skip


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))


@pytest.fixture(scope="session")
def default_model() -> Path:
    """Prepared once per machine (cached), before any server starts, so start-up timeouts stay honest."""
    return ensure_default_model()


class Servers:
    """Every server the tests start. Each is stopped at the end of the module that started it, the shared one at
    the session's end, so a run holds only the servers of the module it is in (two run side by side, one module
    each: scripts/check.sh).

    A module's servers are told to stop when it ends, and the next module starts at once: a thread waits for them
    to exit (and kills one that hangs) while the next module's tests run on the servers already up. Their shutdown
    is seconds of a worker's wall time that needs little CPU. A new server starts only once they are gone, so a
    worker never holds more servers' memory at once than when each module waited for its own (two workers' servers
    used up to 19 GB of this machine's 24 in a run). The session's end waits for every one.
    """

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self._tmp_path_factory = tmp_path_factory
        self._module: list[ServerProcess] = []
        self._session: list[ServerProcess] = []
        self._stopping: list[threading.Thread] = []

    def start(
        self, *extra_args: str, wait: bool = True, env: dict[str, str] | None = None, shared: bool = False
    ) -> ServerProcess:
        self._wait_stopped()
        log = self._tmp_path_factory.mktemp("server") / "serve.log"
        server = ServerProcess(log, tuple(extra_args), env)
        (self._session if shared else self._module).append(server)
        if wait:
            server.wait_serving()
        return server

    def stop_module_servers(self) -> None:
        servers, self._module = self._module, []
        if servers:
            waiting = threading.Thread(target=self._stop, args=(servers,), name="stopping-servers", daemon=True)
            waiting.start()
            self._stopping.append(waiting)

    def stop_all(self) -> None:
        servers, self._module, self._session = [*self._module, *self._session], [], []
        self._stop(servers)
        self._wait_stopped()

    def _wait_stopped(self) -> None:
        while self._stopping:
            self._stopping.pop().join()

    @staticmethod
    def _stop(servers: list[ServerProcess]) -> None:
        """All of them at once: each is told to stop, then each is waited for (and killed if it hangs)."""
        for server in servers:
            server.terminate()
        while servers:
            servers.pop().stop()


@pytest.fixture(scope="session")
def started_servers(default_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    started = Servers(tmp_path_factory)
    try:
        yield started
    finally:
        started.stop_all()


@pytest.fixture(scope="session")
def start_server(started_servers: Servers) -> Callable[..., ServerProcess]:
    return started_servers.start


@pytest.fixture(scope="module", autouse=True)
def _stop_the_modules_servers(started_servers: Servers) -> Iterator[None]:
    """After the module's own fixtures are torn down (an autouse fixture is set up first), what it left running."""
    yield
    started_servers.stop_module_servers()


@pytest.fixture(scope="session")
def otlp_receiver() -> Iterator[OtlpReceiver]:
    receiver = OtlpReceiver()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="session")
def server(start_server: Callable[..., ServerProcess], otlp_receiver: OtlpReceiver) -> ServerProcess:
    """The shared server traces every request to a real OTLP receiver run by the tests, and is priced so the
    cost series and the dashboard's cost panels have data. Its context is SHARED_CONTEXT tokens."""
    return start_server(
        "--max-model-len",
        str(SHARED_CONTEXT),
        "--otlp-endpoint",
        f"http://127.0.0.1:{otlp_receiver.port}",
        "--accelerator-cost-per-hour",
        "2.5",
        # Export batches every 100 ms instead of every 5 s, so tests see spans quickly.
        env={"OTEL_BSP_SCHEDULE_DELAY": "100"},
        shared=True,
    )


@pytest.fixture
def client(server: ServerProcess) -> Iterator[Client]:
    with server.client() as c:
        yield c
