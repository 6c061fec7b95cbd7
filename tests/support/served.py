"""A server as production wires it (`phasescope.serve.build.build_server`) over the scripted engine, on a free
port in this process, with a client of each protocol: the unit tests' one way to serve.

    async with served(ScriptedEngine()) as s:
        answer = await s.client.generate(build_request(prompt="a b", max_tokens=2))
        assert s.value("phasescope_requests_total", code="OK", finish_reason="length") == 1
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import grpc
from prometheus_client import CollectorRegistry

from phasescope.client.client import AsyncClient
from phasescope.serve.build import Built, build_server
from phasescope.serve.config import Settings
from phasescope.telemetry.hardware.peaks import HardwarePeaks
from phasescope.telemetry.step.aggregator import StepAggregator
from support.engine_protocol import engine_stub_on
from support.fake_engine import ScriptedEngine

MODEL = "scripted"
PEAKS = HardwarePeaks("toy", 100e9, {"fp32": 1e12}, "flag", "toy")


def settings(**overrides: Any) -> Settings:
    """Settings for a scripted server: both peaks given (nothing is measured), free ports."""
    values: dict[str, Any] = {
        "model": "/models/scripted",
        "port": 0,
        "metrics_port": 0,
        "peak_memory_bandwidth": 100e9,
        "peak_flops": 1e12,
        "shutdown_grace_seconds": 5,
        "max_concurrent_requests": 4,
        "max_queued_requests": 0,
    }
    return Settings(**{**values, **overrides})


class Served:
    """A running in-process server and what a test reads of it."""

    def __init__(self, built: Built, engine: ScriptedEngine, client: AsyncClient, channel: grpc.aio.Channel) -> None:
        self.built = built
        self.engine = engine
        self.client = client
        self.registry = built.registry
        self.channel = channel
        self.stub: Any = engine_stub_on(channel)
        """vLLM's engine protocol (`client` speaks phasescope.v1)."""

    @property
    def steps(self) -> StepAggregator:
        assert self.built.aggregator is not None  # attached at start
        return self.built.aggregator

    def value(self, name: str, **labels: str) -> float:
        """The sum of a series' samples over every label set that includes `labels` (and this model), in the
        server's registry (collecting it hands on what the telemetry pipeline holds)."""
        wanted = {"model": MODEL, **labels}
        return sum(
            sample.value
            for family in self.registry.collect()
            for sample in family.samples
            if sample.name == name and wanted.items() <= sample.labels.items()
        )


@asynccontextmanager
async def served(engine: ScriptedEngine | None = None, **overrides: Any) -> AsyncIterator[Served]:
    """`build_server` over `engine` (a plain scripted one by default) with `settings(**overrides)`, serving on a
    free loopback port until the block ends."""
    engine = engine if engine is not None else ScriptedEngine()
    built = build_server(settings(**overrides), MODEL, registry=CollectorRegistry(), engine=engine, peaks=PEAKS)
    port = built.grpc.add_insecure_port("127.0.0.1:0")
    await built.grpc.start()
    try:
        async with (
            AsyncClient(f"127.0.0.1:{port}", timeout_seconds=10) as client,
            grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel,
        ):
            yield Served(built, engine, client, channel)
    finally:
        await built.grpc.stop(grace=None)


async def eventually(condition: Callable[[], bool], within_seconds: float = 5.0) -> None:
    """The server finishes a request's bookkeeping just after the client sees its status."""
    deadline = asyncio.get_running_loop().time() + within_seconds
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.01)
