"""The server's lifecycle without vLLM: health while the engine starts, serving, draining, engine death."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import sys
import threading
from collections.abc import AsyncIterator

import grpc
import pytest
from prometheus_client import CollectorRegistry

from phasescope.client.client import AsyncClient, build_request
from phasescope.engine.base import EngineConfigError
from phasescope.errors import EngineUnavailableError
from phasescope.serve.app import Server, event_loop_factory
from phasescope.serve.config import Settings, SettingsError, parse_settings
from phasescope.telemetry.pipeline import TelemetryPipeline
from phasescope.telemetry.step.records import StepForwarder
from support.fake_engine import Script, ScriptedEngine

SETTINGS = Settings(
    model="/models/scripted",
    port=0,
    metrics_port=0,
    # Flags for both peaks: nothing is measured.
    peak_memory_bandwidth=100e9,
    peak_flops=1e12,
    shutdown_grace_seconds=5,
)


class Factory:
    """Starts a scripted engine when released, as a slow weight load would."""

    def __init__(self) -> None:
        self.engine = ScriptedEngine()
        self.release = threading.Event()

    def __call__(
        self, settings: Settings, model_path: str, model_name: str, steps: StepForwarder, pipeline: TelemetryPipeline
    ) -> ScriptedEngine:
        # Known by --model as given, as vLLM's worker names its model.
        assert (model_path, model_name) == ("/models/scripted", "/models/scripted")
        self.release.wait(10)
        return self.engine


async def wait_for_port(server: Server) -> str:
    for _ in range(500):
        if server.grpc_port:
            return f"127.0.0.1:{server.grpc_port}"
        await asyncio.sleep(0.01)
    raise AssertionError("the server never listened")


async def wait_for_health(client: AsyncClient, wanted: str) -> list[str]:
    seen: list[str] = []
    for _ in range(500):
        status = await client.health()
        if not seen or seen[-1] != status:
            seen.append(status)
        if status == wanted:
            return seen
        await asyncio.sleep(0.01)
    raise AssertionError(f"health never said {wanted}: {seen}")


@contextlib.asynccontextmanager
async def serving(factory: Factory) -> AsyncIterator[tuple[Server, asyncio.Task[int], AsyncClient]]:
    """A server on the released scripted engine, its run() task, and a client, once health says SERVING."""
    factory.release.set()
    server = Server(SETTINGS, CollectorRegistry(), engine_factory=factory)
    running = asyncio.create_task(server.run())
    async with AsyncClient(await wait_for_port(server), timeout_seconds=5) as client:
        await wait_for_health(client, "SERVING")
        yield server, running, client


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_health_follows_the_engine_then_a_drain_stops_it_cleanly(loop: str) -> None:
    if loop == "uvloop":
        pytest.importorskip("uvloop")  # installed with vLLM: the served default
    factory = Factory()

    async def scenario() -> tuple[list[str], str, int, grpc.StatusCode]:
        server = Server(SETTINGS, CollectorRegistry(), engine_factory=factory)
        running = asyncio.create_task(server.run())
        async with AsyncClient(await wait_for_port(server), timeout_seconds=5) as client:
            # Listening before the engine is up, and saying so.
            assert await client.health() == "NOT_SERVING"
            with_engine_starting = client.generate(build_request(prompt="too early", max_tokens=2))
            try:
                await with_engine_starting
                early = grpc.StatusCode.OK
            except grpc.aio.AioRpcError as exc:
                early = exc.code()
            factory.release.set()
            history = await wait_for_health(client, "SERVING")
            answer = await client.generate(build_request(prompt="hello there", max_tokens=3))
            server.request_stop()
            code = await running
        return history, answer.text, code, early

    with asyncio.Runner(loop_factory=event_loop_factory(loop)) as runner:
        history, text, code, early = runner.run(scenario())
    assert early is grpc.StatusCode.UNAVAILABLE
    assert history[-1] == "SERVING"
    assert factory.engine.warmed_up
    assert text == "t11 t12 t13 "
    assert code == 0
    assert factory.engine.closed


async def test_a_configuration_the_engine_refuses_exits_2_with_one_line_naming_the_flag(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # What vLLM's refusal becomes is tests/engine/test_speculative_config.py's (no server needed there either).
    refusal = "--speculative-config: num_speculative_tokens must be > 0, got -1"

    def refuses(*args: object) -> ScriptedEngine:
        raise EngineConfigError(refusal)

    server = Server(SETTINGS, CollectorRegistry(), engine_factory=refuses)
    with caplog.at_level(logging.ERROR, logger="phasescope.serve.app"):
        code = await asyncio.wait_for(server.run(), 10)
    assert code == 2
    (line,) = [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR]
    assert line == f"the engine refused its configuration: {refusal}"


async def test_a_dead_engine_turns_health_off_and_the_process_exits_1() -> None:
    factory = Factory()

    async def scenario() -> tuple[int, str]:
        async with serving(factory) as (_, running, _):
            factory.engine.dead = True
            code = await asyncio.wait_for(running, 10)
        return code, "closed" if factory.engine.closed else "open"

    code, engine_state = await scenario()
    assert code == 1
    assert engine_state == "closed"


async def test_a_request_that_meets_a_dead_engine_sees_health_off_first_and_the_log_names_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Guards issue 45: the death was told to clients up to a second before health said NOT_SERVING.
    factory = Factory()

    def script(prompt: list[int]) -> Script:
        if prompt[0] == 666:
            # The engine dies under this request (vLLM's EngineDeadError, as the adapter translates it).
            return Script(fail_after=1, failure=EngineUnavailableError("the engine died while this request ran"))
        return Script(hang_after=1)

    factory.engine = ScriptedEngine(script)

    async def scenario() -> tuple[grpc.StatusCode, str, str, int]:
        async with serving(factory) as (_, running, client):
            bystander = client.generate(build_request(token_ids=[7, 8], max_tokens=50, request_id="bystander-1"))
            bystander_task = asyncio.ensure_future(bystander)
            await asyncio.sleep(0.05)
            try:
                await client.generate(build_request(token_ids=[666, 1], max_tokens=8, request_id="killer-7"))
                code, message = grpc.StatusCode.OK, ""
            except grpc.aio.AioRpcError as exc:
                code, message = exc.code(), exc.details() or ""
            # Asked at once: the status left only after health had turned.
            health = await client.health()
            bystander_task.cancel()
            exit_code = await asyncio.wait_for(running, 10)
        return code, message, health, exit_code

    with caplog.at_level(logging.ERROR, logger="phasescope.serve.app"):
        code, message, health, exit_code = await scenario()
    assert code is grpc.StatusCode.UNAVAILABLE
    assert "the engine died" in message
    assert health == "NOT_SERVING"
    assert exit_code == 1
    deaths = [record.getMessage() for record in caplog.records if "the engine died" in record.getMessage()]
    assert len(deaths) == 1
    assert "killer-7" in deaths[0]
    assert "bystander-1" in deaths[0]


def test_the_event_loop_is_uvloop_when_installed_and_asyncio_on_request(monkeypatch: pytest.MonkeyPatch) -> None:
    assert event_loop_factory("asyncio") is None
    uvloop = pytest.importorskip("uvloop")
    assert event_loop_factory("auto") is uvloop.new_event_loop
    assert event_loop_factory("uvloop") is uvloop.new_event_loop
    monkeypatch.setitem(sys.modules, "uvloop", None)  # as if not installed
    assert event_loop_factory("auto") is None
    with pytest.raises(SettingsError, match="uvloop is not installed"):
        event_loop_factory("uvloop")
    with pytest.raises(SettingsError, match="--event-loop must be auto, uvloop or asyncio"):
        parse_settings(["--event-loop", "trio"], environ={})


async def test_the_start_up_heap_is_kept_out_of_collections_while_serving_and_released_at_stop() -> None:
    factory = Factory()
    before = gc.get_threshold()

    async def scenario() -> tuple[bool, int, int]:
        async with serving(factory) as (server, running, _):
            # A full collection now skips everything alive at start-up.
            tracked = {id(o) for o in gc.get_objects()}
            start_up_held_back = id(factory.engine) not in tracked and gc.get_freeze_count() > 0
            young = gc.get_threshold()[0]
            server.request_stop()
            code = await running
        return start_up_held_back, young, code

    try:
        held_back, young, code = await scenario()
        assert code == 0
        assert held_back
        # While serving, the youngest generation waits for 50 objects per running request (64 by default).
        assert young == 3200
        # Stopped: the engine's objects are collectable again (an engine closed in-process is freed), and
        # Python's threshold is back.
        assert gc.get_freeze_count() == 0
        assert gc.get_threshold() == before
        assert any(o is factory.engine for o in gc.get_objects())
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


async def test_the_telemetry_pipeline_waits_on_this_servers_requests_first_tokens() -> None:
    factory = Factory()
    factory.engine = ScriptedEngine(lambda prompt: Script(queue_seconds=0.3))
    async with serving(factory) as (server, running, client):
        assert server.built is not None
        waits = server.built.pipeline.waits
        assert waits is server.built.path.first_token_waits
        answer = asyncio.create_task(client.generate(build_request(prompt="a slow first token", max_tokens=2)))
        for _ in range(200):
            if waits:
                break
            await asyncio.sleep(0.005)
        assert waits.count == 1
        await answer
        assert waits.count == 0
        server.request_stop()
        await running


@pytest.mark.parametrize(
    ("flags", "threshold"),
    [
        ([], 3200),
        (["--max-concurrent-requests", "8"], 700),
        (["--max-concurrent-requests", "128", "--data-parallel-size", "2"], 12800),
        (["--gc-young-threshold", "20000"], 20000),
    ],
)
def test_the_youngest_generation_waits_for_a_batch_of_outputs(flags: list[str], threshold: int) -> None:
    assert parse_settings(flags, environ={}).effective_gc_young_threshold == threshold
