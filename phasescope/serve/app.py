"""Builds and runs the server: gRPC (inference, health, reflection), /metrics, the engine, and draining.

Start-up order matters to operators: gRPC and /metrics listen at once with
health NOT_SERVING, the model is prepared and the engine started off the
event loop, a warm-up request runs, and only then health says SERVING.
SIGTERM or SIGINT drains: health NOT_SERVING, new requests refused with
UNAVAILABLE, in-flight ones given `--shutdown-grace-seconds`, then the engine
stops. A dead engine turns health NOT_SERVING and the process exits 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import threading
import time
from collections.abc import Callable
from wsgiref.simple_server import WSGIServer

from grpc_health.v1 import health_pb2
from prometheus_client import REGISTRY, CollectorRegistry, disable_created_metrics

from phasescope.engine.base import Engine, EngineConfigError
from phasescope.engine.default_model import DEFAULT_MODEL_NAME, ensure_default_model
from phasescope.engine.vllm import TELEMETRY_SCHEDULER
from phasescope.environment import TELEMETRY_ENDPOINT, env_auth_tokens, export_telemetry_endpoint
from phasescope.serve.auth import server_credentials
from phasescope.serve.build import Built, build_server
from phasescope.serve.config import Settings, SettingsError
from phasescope.serve.cpu_affinity import keep_off_worker_cpus
from phasescope.serve.hub import HubTelemetry, hub_telemetry
from phasescope.serve.rust_mode import V1BesideRust, loopback, rust_server_answers
from phasescope.telemetry.endpoint import start_metrics_server
from phasescope.telemetry.pipeline import TelemetryPipeline
from phasescope.telemetry.step.records import StepForwarder

logger = logging.getLogger(__name__)

ENGINE_WATCH_INTERVAL_SECONDS = 1.0


def resolve_model(settings: Settings) -> tuple[str, str]:
    """(path or hub id to load, name to serve it as); prepares the embedded default when --model is empty."""
    if settings.model:
        # As vLLM's own worker: the model is known by --model exactly as given (a path or a hub id), which is
        # what gateways and clients configured for vLLM send.
        return settings.model, settings.served_model_name or settings.model
    return str(ensure_default_model()), settings.served_model_name or DEFAULT_MODEL_NAME


EngineFactory = Callable[[Settings, str, str, StepForwarder, TelemetryPipeline], Engine]
"""Starts an engine (blocking: it runs on a worker thread): settings, model path, served name, where its
per-step reports go, and the pipeline its own series wait in."""


def start_vllm_engine(
    settings: Settings, model_path: str, model_name: str, steps: StepForwarder, pipeline: TelemetryPipeline
) -> Engine:
    from phasescope.engine.vllm.engine import VllmEngine

    return VllmEngine.start(settings.engine_options(), model_path, model_name, steps, pipeline)


class Server:
    """One phasescope process: it starts what `build_server` wired, serves, and stops it all."""

    def __init__(
        self,
        settings: Settings,
        registry: CollectorRegistry = REGISTRY,
        engine_factory: EngineFactory = start_vllm_engine,
    ) -> None:
        """`engine_factory` is vLLM's in production; tests hand in a scripted engine."""
        self.settings = settings
        self.registry = registry
        self._engine_factory = engine_factory
        self.exit_code = 0
        self._stop = asyncio.Event()
        self.built: Built | None = None
        self.grpc_port = 0
        self.metrics_port = 0

    def request_stop(self) -> None:
        if self._stop.is_set():
            return
        logger.info("stop requested: draining")
        self._stop.set()

    async def run(self) -> int:
        settings = self.settings
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.request_stop)
        model_path, model_name = await asyncio.to_thread(resolve_model, settings)
        # `*_created` series double the exposition and no dashboard reads them.
        disable_created_metrics()  # type: ignore[no-untyped-call]  # prometheus-client leaves it unannotated
        built = self.built = build_server(
            settings, model_name, registry=self.registry, on_engine_dead=self._engine_died
        )
        # Torn down in reverse: gRPC first (the `finally` below), then the start-up heap, the engine, the GPU
        # counters, the spans still batched, /metrics.
        async with contextlib.AsyncExitStack() as stack:
            metrics_server, metrics_thread = start_metrics_server(
                settings.metrics_port, settings.effective_metrics_host, self.registry
            )
            stack.callback(_stop_metrics, metrics_server, metrics_thread)
            self.metrics_port = metrics_server.server_port
            if built.tracing is not None:
                stack.push_async_callback(asyncio.to_thread, built.tracing.provider.shutdown)
            try:
                self.grpc_port = await self._listen(built)
                logger.info(
                    "gRPC listening on %s:%d (health NOT_SERVING until the engine is warm); metrics on "
                    "http://%s:%d/metrics",
                    settings.host,
                    self.grpc_port,
                    settings.effective_metrics_host,
                    self.metrics_port,
                )
                await self._serve(built, model_path, model_name, stack)
            finally:
                await built.health.enter_graceful_shutdown()
                await built.grpc.stop(grace=1.0)
                built.pipeline.hand_on()  # what the last requests left held
        logger.info("stopped")
        return self.exit_code

    async def _serve(self, built: Built, model_path: str, model_name: str, stack: contextlib.AsyncExitStack) -> None:
        """Start the engine, serve until asked to stop, drain."""
        engine = await self._start_engine(built, model_path, model_name, stack)
        if engine is None:
            return
        decided = await asyncio.to_thread(built.decide_for, engine)
        if decided.pin_front_end:
            await asyncio.to_thread(_pin_front_end)
        built.attach_engine(engine, decided.peaks, gpu_counters=decided.gpu_counters)
        if decided.gpu_counters is not None:
            decided.gpu_counters.start()
            stack.callback(decided.gpu_counters.close)
        await engine.warm_up()
        young = self.settings.effective_gc_young_threshold
        frozen, python_young = freeze_startup_heap(young)
        # The engine's start-up objects become collectable again as it closes.
        stack.callback(thaw_startup_heap, python_young)
        await built.set_health(health_pb2.HealthCheckResponse.SERVING)
        logger.info(
            "ready: serving %s (health SERVING; %d startup objects kept out of collections, "
            "the youngest generation collected every %d objects)",
            model_name,
            frozen,
            young,
        )
        watcher = asyncio.create_task(self._watch_engine(engine))
        await self._stop.wait()
        watcher.cancel()
        await self._drain(built)

    async def _listen(self, built: Built) -> int:
        settings = self.settings
        await built.set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        listen = f"{settings.host}:{settings.port}"
        if settings.tls_cert_file:
            credentials = server_credentials(settings.tls_cert_file, settings.tls_key_file, settings.tls_client_ca_file)
            port = built.grpc.add_secure_port(listen, credentials)
            logger.info(
                "TLS on%s", " with client certificates required (mutual TLS)" if settings.tls_client_ca_file else ""
            )
        else:
            port = built.grpc.add_insecure_port(listen)
        await built.grpc.start()
        return port

    async def _start_engine(
        self, built: Built, model_path: str, model_name: str, stack: contextlib.AsyncExitStack
    ) -> Engine | None:
        """Start the engine off the event loop, so health answers while weights load; None when asked to stop
        meanwhile, or when the engine refused its configuration."""
        started = time.monotonic()
        logger.info("starting the engine for %s (%s)", model_name, model_path)
        start = asyncio.create_task(
            asyncio.to_thread(self._engine_factory, self.settings, model_path, model_name, built.steps, built.pipeline)
        )
        stop = asyncio.create_task(self._stop.wait())
        await asyncio.wait((start, stop), return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        # A start-up thread cannot be interrupted: wait for it even when asked to stop, so its engine processes
        # are shut down rather than orphaned.
        try:
            engine = await start
        except EngineConfigError as exc:
            logger.error("the engine refused its configuration: %s", exc)
            self.exit_code = 2
            return None
        stack.push_async_callback(self._close_engine, engine)
        if self._stop.is_set():
            return None
        logger.info("engine started in %.1f s", time.monotonic() - started)
        return engine

    @staticmethod
    async def _close_engine(engine: Engine) -> None:
        logger.info("stopping the engine")
        await engine.close()

    async def _watch_engine(self, engine: Engine) -> None:
        """Notices a death no request has met yet (an idle engine's)."""
        while True:
            await asyncio.sleep(ENGINE_WATCH_INTERVAL_SECONDS)
            if engine.is_dead:
                await self._engine_died()
                return

    async def _engine_died(self) -> None:
        """Once, at the first sign: health NOT_SERVING, the requests that were running named in the log (their
        ids, never their text: an operator finds the one that killed it in vLLM's own dump of the step), and
        the server stops with exit code 1 so its supervisor restarts it."""
        built = self.built
        if self.exit_code or built is None:
            return
        self.exit_code = 1
        await built.set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        running = sorted(
            f"{request.request_id} (engine id {request.engine_request_id})"
            for request in built.path.in_flight
            if request.request_id
        )
        logger.error(
            "the engine died; health is NOT_SERVING and the server exits. Requests in the engine when it died (%d): %s",
            len(running),
            ", ".join(running) or "none",
        )
        self.request_stop()

    async def _drain(self, built: Built) -> None:
        built.path.draining = True
        await built.health.enter_graceful_shutdown()
        admission = built.path.admission
        grace = self.settings.shutdown_grace_seconds
        if admission.in_flight:
            logger.info("draining %d in-flight requests (up to %.0f s)", admission.in_flight, grace)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(admission.wait_idle(), timeout=grace)
        if admission.in_flight:
            logger.warning("grace period over: cancelling %d requests", admission.in_flight)


def _stop_metrics(server: WSGIServer, thread: threading.Thread) -> None:
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def event_loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The loop `serve` runs on: uvloop's (what vLLM's own servers run on; docs/benchmarks.md, "Tried and did
    not matter") or asyncio's own (None). `auto` takes uvloop when it is installed (it comes with vLLM)."""
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise SettingsError("--event-loop uvloop: uvloop is not installed (pip install uvloop)") from None
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def serve(settings: Settings, factory: Callable[[], asyncio.AbstractEventLoop] | None = None) -> int:
    """Run the server on the loop `factory` makes (None: asyncio's) until it is stopped; the exit code."""
    logger.info("event loop: %s", "uvloop" if factory is not None else "asyncio")
    with asyncio.Runner(loop_factory=factory) as runner:
        if settings.front_end == "python":
            return runner.run(Server(settings).run())
        return runner.run(serve_behind_another_front_end(settings))


async def serve_behind_another_front_end(settings: Settings, registry: CollectorRegistry = REGISTRY) -> int:
    """phasescope's physics behind a request path that is not phasescope's (`--front-end rust` or `external`): the
    telemetry hub and /metrics, and for rust smg's Rust server over engine cores started here; the exit code."""
    disable_created_metrics()  # type: ignore[no-untyped-call]  # prometheus-client leaves it unannotated
    if settings.front_end == "rust" and env_auth_tokens():
        logger.error("--front-end rust: smg's Rust server checks no bearer tokens; unset PHASESCOPE_AUTH_TOKENS")
        return 2
    async with hub_telemetry(settings, registry) as telemetry:
        if settings.front_end == "external":
            logger.info(
                "serving the telemetry of engine cores started elsewhere: start them with "
                "%s=%s and --scheduler-cls %s --enable-mfu-metrics",
                TELEMETRY_ENDPOINT,
                telemetry.endpoint,
                TELEMETRY_SCHEDULER,
            )
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(signum, stop.set)
            await stop.wait()
            return 0
        from phasescope.engine.vllm.rust_front_end import serve_rust

        model_path, model_name = await asyncio.to_thread(resolve_model, settings)
        # The engine cores the Rust server starts inherit the hub's address.
        export_telemetry_endpoint(telemetry.endpoint)
        v1 = V1BesideRust(settings, telemetry, model_path, model_name)
        up = asyncio.create_task(_once_up(settings, telemetry, v1))
        up.add_done_callback(_up_failed)
        try:
            return await serve_rust(settings.engine_options(), model_path, model_name, settings.host, settings.port)
        except EngineConfigError as exc:
            logger.error("the engine refused its configuration: %s", exc)
            return 2
        finally:
            await _stop_v1(v1, up)


async def _once_up(settings: Settings, telemetry: HubTelemetry, v1: V1BesideRust) -> None:
    """Behind smg's Rust server, once it answers and its engine cores have said what they are: phasescope.v1 beside it
    (unless --v1-port 0), then, as the Python front end does once its engine is up, the start-up heap kept out of
    collections (until the process exits: its engine cores are other processes) and the youngest generation's
    threshold raised (the hub's reports and phasescope.v1's requests allocate here), and with --pin-front-end on a
    CPU this process (the Rust server's threads with it) and the engine cores off the CPUs the workers were bound
    to."""
    if not await rust_server_answers(f"{loopback(settings.host)}:{settings.port}", v1.stopping):
        return
    await telemetry.ready.wait()
    if settings.effective_v1_port:
        try:
            await v1.serve()
        except Exception as exc:  # the Rust server serves on without it
            logger.error(
                "phasescope.v1 beside smg's Rust server did not start (the Rust server serves on): %s",
                exc,
                exc_info=exc,
            )
    young = settings.effective_gc_young_threshold
    frozen, _ = freeze_startup_heap(young)
    logger.info(
        "up: %d start-up objects kept out of collections, the youngest generation collected every %d objects",
        frozen,
        young,
    )
    if settings.pin_front_end and telemetry.description is not None and telemetry.description.on_cpu:
        await asyncio.to_thread(_pin_front_end)


def _up_failed(up: asyncio.Task[None]) -> None:
    if not up.cancelled() and (exc := up.exception()) is not None:
        logger.error(
            "behind smg's Rust server, phasescope.v1, the heap freeze and the pinning did not happen: %s",
            exc,
            exc_info=exc,
        )


async def _stop_v1(v1: V1BesideRust, up: asyncio.Task[None]) -> None:
    """phasescope.v1 beside the Rust server stopped (the start-up, if still under way, cancelled)."""
    v1.stopping.set()
    up.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await up
    await v1.stop()


def freeze_startup_heap(young_threshold: int) -> tuple[int, int]:
    """Keep everything alive after start-up out of every later garbage collection, and collect the youngest
    generation only after `young_threshold` more objects; how many objects were kept out, and the threshold
    it replaced (`thaw_startup_heap` puts it back).

    vLLM's OpenAI server freezes the same way once it is up (`vllm.utils.gc_utils.freeze_gc_heap`, not called
    here: only the vLLM adapter may import vLLM, and this is three lines of the standard library). Without
    it a full collection walks the whole start-up heap (torch, transformers, vLLM) and holds the event loop
    while every stream waits. At Python's threshold of 700, a large batch's outputs set off collections of the
    youngest generation that walk those outputs while they are still in use (`Settings.gc_young_threshold`;
    docs/benchmarks.md, "Settings that change the cost per token").
    """
    gc.collect()
    gc.freeze()
    replaced = _set_young_threshold(young_threshold)
    return gc.get_freeze_count(), replaced


def thaw_startup_heap(young_threshold: int) -> None:
    """The start-up objects collectable again (an engine's, as it closes), the youngest generation collected
    every `young_threshold` objects again."""
    gc.unfreeze()
    _set_young_threshold(young_threshold)


def _set_young_threshold(threshold: int) -> int:
    """The youngest generation collected every `threshold` objects (the older ones as they were); the
    threshold it replaced."""
    replaced, *older = gc.get_threshold()
    gc.set_threshold(threshold, *older)
    return replaced


def _pin_front_end() -> None:
    pinning = keep_off_worker_cpus()
    if pinning is None:
        logger.info(
            "front end not pinned: no engine worker is bound to part of this process's CPUs, "
            "or the workers' bindings leave no CPU free"
        )
        return
    logger.info(
        "pinned the front end and engine core (pids %s) to CPUs %s, off CPUs %s where the engine's workers "
        "(pids %s) compute",
        ", ".join(map(str, pinning.moved)),
        _cpu_list(pinning.serving_cpus),
        _cpu_list(pinning.worker_cpus),
        ", ".join(map(str, pinning.workers)),
    )


def _cpu_list(cpus: frozenset[int]) -> str:
    return ",".join(map(str, sorted(cpus)))
