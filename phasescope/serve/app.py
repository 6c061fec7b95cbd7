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
import functools
import gc
import logging
import signal
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import REGISTRY, CollectorRegistry, disable_created_metrics

from phasescope.engine.base import Engine, EngineConfigError
from phasescope.engine.default_model import DEFAULT_MODEL_NAME, ensure_default_model
from phasescope.environment import env_auth_tokens, env_cuda_devices
from phasescope.serve.admission import Admission
from phasescope.serve.auth import BearerTokenInterceptor, caller_identity, load_tokens, server_credentials
from phasescope.serve.config import Settings, SettingsError
from phasescope.serve.cpu_affinity import keep_off_worker_cpus
from phasescope.serve.engine_protocol.servicer import SERVICE_NAME as ENGINE_PROTOCOL_SERVICE
from phasescope.serve.engine_protocol.servicer import VllmEngineServicer, engine_protocol_handler
from phasescope.serve.inference import SERVICE_NAME, InferenceServicer, inference_handler
from phasescope.serve.interceptors import ExceptionToStatusInterceptor
from phasescope.serve.lifecycle import RequestPath
from phasescope.serve.peaks import engine_cost_per_hour, per_engine_peaks, resolve_peaks, with_memory_capacity
from phasescope.serve.tracing_setup import build_tracing
from phasescope.serve.watch import ServerFacts
from phasescope.telemetry.endpoint import start_metrics_server
from phasescope.telemetry.errors import TelemetryErrors
from phasescope.telemetry.hardware.gpu_counters import GpmSampler, start_gpu_counters
from phasescope.telemetry.held import FIRST_TOKEN_WAITS, nobody_waits
from phasescope.telemetry.live import LatencyFigures, RecentLatencies
from phasescope.telemetry.request.observer import ObserverGroup, RequestObserver
from phasescope.telemetry.request.prometheus import PrometheusRequestObserver
from phasescope.telemetry.step.aggregator import EngineView, StepAggregator
from phasescope.telemetry.step.prometheus import StepMetrics
from phasescope.telemetry.step.records import StepForwarder
from phasescope.telemetry.step.verdict import HeadroomLimits

logger = logging.getLogger(__name__)

ENGINE_WATCH_INTERVAL_SECONDS = 1.0
# The engine's step reports handed on together (one per stats update, `StepForwarder.report`: 96 steps);
# every reader (a scrape, WatchTelemetry, GetLoads) hands on what is held before it reads (StepAggregator).
STEP_REPORT_BATCH = 96
# Each request's first-token and end records are held for the Prometheus series and the live view
# (ObserverGroup) until no request waits for its first token, so a wave of new requests has its first
# tokens before the last wave's records are observed; at most this long (under a load that never leaves
# that moment). A scrape or a live view hands them on before it reads.
REQUEST_RECORD_HOLD_SECONDS = 1.0
HEALTH_SERVICE: str = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
# gRPC allows 4 MiB requests by default; a context window of text fits easily.
MAX_MESSAGE_BYTES = 16 * 2**20


def resolve_model(settings: Settings) -> tuple[str, str]:
    """(path or hub id to load, name to serve it as); prepares the embedded default when --model is empty."""
    if settings.model:
        # As vLLM's own worker: the model is known by --model exactly as given (a path or a hub id), which is
        # what gateways and clients configured for vLLM send.
        return settings.model, settings.served_model_name or settings.model
    return str(ensure_default_model()), settings.served_model_name or DEFAULT_MODEL_NAME


EngineFactory = Callable[[Settings, str, str, StepForwarder], Engine]
"""Starts an engine (blocking: it runs on a worker thread): settings, model path, served name,
and where its per-step reports go."""


def start_vllm_engine(settings: Settings, model_path: str, model_name: str, steps: StepForwarder) -> Engine:
    from phasescope.engine.vllm.engine import VllmEngine

    return VllmEngine.start(settings.engine_options(), model_path, model_name, steps)


class Server:
    """One phasescope process: its gRPC server, metrics endpoint, engine and lifecycle."""

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
        self._started = time.monotonic()
        self._stop = asyncio.Event()
        self._engine: Engine | None = None
        self.health = health.aio.HealthServicer()
        self._grpc: grpc.aio.Server | None = None
        self._gpu_counters: GpmSampler | None = None
        # Python's threshold for its youngest generation before serving set its own (put back at stop).
        self._python_gc_young_threshold: int | None = None
        self.grpc_port = 0
        self.metrics_port = 0

    def request_stop(self) -> None:
        if self._stop.is_set():
            return
        logger.info("stop requested: draining")
        self._stop.set()

    async def _set_health(self, status: int) -> None:
        for service in ("", SERVICE_NAME):
            await self.health.set(service, status)

    async def run(self) -> int:
        settings = self.settings
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.request_stop)

        model_path, model_name = await asyncio.to_thread(resolve_model, settings)
        # `*_created` series double the exposition and no dashboard reads them.
        disable_created_metrics()  # type: ignore[no-untyped-call]  # prometheus-client leaves it unannotated
        tracing = build_tracing(settings)
        telemetry_errors = TelemetryErrors(model_name, self.registry)
        recent = RecentLatencies()
        request_metrics = PrometheusRequestObserver(self.registry, model_name)
        observers: list[RequestObserver] = [request_metrics, recent]
        interceptors: list[grpc.aio.ServerInterceptor] = []
        if tracing is not None:
            observers.append(tracing.observer)
            interceptors.append(tracing.interceptor)
        tokens = load_tokens(settings.auth_tokens_file, env_auth_tokens())
        if tokens:
            exempt = (HEALTH_SERVICE, reflection.SERVICE_NAME) if settings.auth_exempt_health else ()
            interceptors.insert(0, BearerTokenInterceptor(tokens, exempt))
            logger.info("bearer-token authentication on (%d tokens)%s", len(tokens), "; health open" if exempt else "")
        # Listed outermost first: authentication, then the server span, which wraps the
        # status mapping so it sees the final status.
        interceptors.append(ExceptionToStatusInterceptor((SERVICE_NAME, ENGINE_PROTOCOL_SERVICE)))
        admission = Admission(
            settings.max_concurrent_requests, settings.max_queued_requests, settings.max_requests_per_client
        )
        records = ObserverGroup(observers, on_error=telemetry_errors, hold_seconds=REQUEST_RECORD_HOLD_SECONDS)
        path = RequestPath(
            records,
            admission,
            model_name,
            trace_id=tracing.trace_id if tracing is not None else lambda: None,
            capture_text=tracing is not None and settings.trace_include_text,
            identify=functools.partial(caller_identity, tokens_checked=bool(tokens)),
        )
        servicer = InferenceServicer(path, max_watchers=settings.max_watchers)
        # vLLM's engine protocol on the same port, over the same path: the smg gateway's door.
        engine_protocol = VllmEngineServicer(path)

        server = grpc.aio.server(
            interceptors=interceptors,
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                # A gateway pings every connection (smg every 30 s), also between requests and while
                # a unary Generate writes nothing: a default server counts those as strikes and ends
                # the connection with GOAWAY(too_many_pings). As vLLM's own gRPC worker allows them.
                ("grpc.http2.max_ping_strikes", 0),
                ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
                ("grpc.keepalive_permit_without_calls", 1),
            ],
        )
        self._grpc = server
        server.add_generic_rpc_handlers((inference_handler(servicer), engine_protocol_handler(engine_protocol)))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, ENGINE_PROTOCOL_SERVICE, HEALTH_SERVICE, reflection.SERVICE_NAME), server
        )
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        listen = f"{settings.host}:{settings.port}"
        if settings.tls_cert_file:
            credentials = server_credentials(settings.tls_cert_file, settings.tls_key_file, settings.tls_client_ca_file)
            self.grpc_port = server.add_secure_port(listen, credentials)
            logger.info(
                "TLS on%s", " with client certificates required (mutual TLS)" if settings.tls_client_ca_file else ""
            )
        else:
            self.grpc_port = server.add_insecure_port(listen)
        await server.start()
        metrics_server, metrics_thread = start_metrics_server(
            settings.metrics_port, settings.effective_metrics_host, self.registry
        )
        self.metrics_port = metrics_server.server_port
        logger.info(
            "gRPC listening on %s:%d (health NOT_SERVING until the engine is warm); metrics on http://%s:%d/metrics",
            settings.host,
            self.grpc_port,
            settings.effective_metrics_host,
            metrics_server.server_port,
        )
        try:
            # Held telemetry (the step reports, vLLM's series) is handed on while no request waits for its first token.
            FIRST_TOKEN_WAITS.watch(path.waiting_for_first_token)
            steps = StepForwarder(on_error=telemetry_errors)
            engine = await self._start_engine(model_path, model_name, steps)
            if engine is None:
                return self.exit_code
            description = engine.description
            peaks = await asyncio.to_thread(
                resolve_peaks, settings, description.device, description.on_cpu, description.dtype
            )
            if description.on_cpu and settings.pin_front_end:
                # After the peaks: a probe measures the whole machine, not the CPUs left to the front end.
                await asyncio.to_thread(_pin_front_end)
            # On a CPU the engine cores share the machine's cores and memory.
            engine_peaks = with_memory_capacity(
                per_engine_peaks(peaks, settings, description.data_parallel_size, description.on_cpu), description
            )
            aggregated = StepAggregator(
                description.cost,
                description.dtype,
                engine_peaks,
                engines=description.data_parallel_size,
                window_seconds=settings.metrics_window_seconds,
                headroom_limits=HeadroomLimits(
                    bandwidth=settings.headroom_bandwidth,
                    compute=settings.headroom_compute,
                    kv_cache=settings.headroom_kv_cache,
                    queue=settings.headroom_queue,
                ),
                cost_per_hour=engine_cost_per_hour(settings, description),
                sinks=(recent,),
                kv_cache_capacity_tokens=description.kv_cache_capacity_tokens,
                batch_reports=STEP_REPORT_BATCH,
                on_error=telemetry_errors,
            )
            StepMetrics(model_name, aggregated, self.registry)
            request_metrics.cost = description.cost  # what a prefix-cache hit saves, in FLOPs
            steps.sink = aggregated.record
            steps.iteration_sink = aggregated.record_iteration
            steps.queue_sink = aggregated.record_queue
            steps.report_sink = aggregated.record_report
            steps.held_sink = aggregated.record_held
            path.interference = aggregated.read_interference
            path.on_engine_dead = functools.partial(self._engine_died, path)
            if not description.on_cpu:
                self._gpu_counters = await asyncio.to_thread(
                    start_gpu_counters, self.registry, model_name, environ=env_cuda_devices()
                )
            logger.info(
                "judging utilisation against %s peaks of %s: %.3g GB/s, %.3g TFLOP/s %s (ridge %.1f FLOP/byte)",
                peaks.source,
                peaks.description or peaks.device,
                aggregated.peak_memory_bandwidth_bytes_per_second / 1e9,
                aggregated.peak_flops / 1e12,
                description.dtype,
                aggregated.peak_flops / aggregated.peak_memory_bandwidth_bytes_per_second,
            )
            await engine.warm_up()
            servicer.attach_engine(engine, engine_peaks)
            live = LiveTelemetry(aggregated, recent)
            servicer.attach_telemetry(
                ServerFacts(model_name, description.device, description.dtype, engine_peaks, self._started), live
            )
            engine_protocol.attach_telemetry(live)
            young = settings.effective_gc_young_threshold
            frozen, self._python_gc_young_threshold = freeze_startup_heap(young)
            await self._set_health(health_pb2.HealthCheckResponse.SERVING)
            logger.info(
                "ready: serving %s (health SERVING; %d startup objects kept out of collections, "
                "the youngest generation collected every %d objects)",
                model_name,
                frozen,
                young,
            )
            watcher = asyncio.create_task(self._watch_engine(engine, path))
            await self._stop.wait()
            watcher.cancel()
            await self._drain(servicer)
        finally:
            await self.health.enter_graceful_shutdown()
            await server.stop(grace=1.0)
            records.hand_on()  # what the last requests left held
            FIRST_TOKEN_WAITS.watch(nobody_waits)
            if self._python_gc_young_threshold is not None:
                # The engine's start-up objects become collectable again as it closes.
                thaw_startup_heap(self._python_gc_young_threshold)
            if self._engine is not None:
                logger.info("stopping the engine")
                await self._engine.close()
            if self._gpu_counters is not None:
                self._gpu_counters.close()
            if tracing is not None:
                # Flushes the spans still batched.
                await asyncio.to_thread(tracing.provider.shutdown)
            metrics_server.shutdown()
            metrics_server.server_close()
            metrics_thread.join(timeout=5)
            logger.info("stopped")
        return self.exit_code

    async def _start_engine(self, model_path: str, model_name: str, steps: StepForwarder) -> Engine | None:
        """Start the engine off the event loop, so health answers while weights load."""
        started = time.monotonic()
        logger.info("starting the engine for %s (%s)", model_name, model_path)
        start = asyncio.create_task(
            asyncio.to_thread(self._engine_factory, self.settings, model_path, model_name, steps)
        )
        stop = asyncio.create_task(self._stop.wait())
        await asyncio.wait((start, stop), return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        # A start-up thread cannot be interrupted: wait for it even when asked to stop,
        # so its engine processes are shut down rather than orphaned.
        try:
            engine = await start
        except EngineConfigError as exc:
            logger.error("the engine refused its configuration: %s", exc)
            self.exit_code = 2
            return None
        self._engine = engine
        if self._stop.is_set():
            return None
        logger.info("engine started in %.1f s", time.monotonic() - started)
        return engine

    async def _watch_engine(self, engine: Engine, path: RequestPath) -> None:
        """Notices a death no request has met yet (an idle engine's)."""
        while True:
            await asyncio.sleep(ENGINE_WATCH_INTERVAL_SECONDS)
            if engine.is_dead:
                await self._engine_died(path)
                return

    async def _engine_died(self, path: RequestPath) -> None:
        """Once, at the first sign: health NOT_SERVING, the requests that were running named in the log (their
        ids, never their text: an operator finds the one that killed it in vLLM's own dump of the step), and
        the server stops with exit code 1 so its supervisor restarts it."""
        if self.exit_code:
            return
        self.exit_code = 1
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        running = sorted(
            f"{request.request_id} (engine id {request.engine_request_id})"
            for request in path.in_flight
            if request.request_id
        )
        logger.error(
            "the engine died; health is NOT_SERVING and the server exits. Requests in the engine when it died (%d): %s",
            len(running),
            ", ".join(running) or "none",
        )
        self.request_stop()

    async def _drain(self, servicer: InferenceServicer) -> None:
        servicer.start_draining()
        await self.health.enter_graceful_shutdown()
        grace = self.settings.shutdown_grace_seconds
        in_flight = servicer.admission.in_flight
        if in_flight:
            logger.info("draining %d in-flight requests (up to %.0f s)", in_flight, grace)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(servicer.admission.wait_idle(), timeout=grace)
        if servicer.admission.in_flight:
            logger.warning("grace period over: cancelling %d requests", servicer.admission.in_flight)


def event_loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The loop `serve` runs on: uvloop's (what vLLM's own servers run on; its scheduling costs less per
    streamed chunk) or asyncio's own (None). `auto` takes uvloop when it is installed (it comes with vLLM)."""
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
        return runner.run(Server(settings).run())


def freeze_startup_heap(young_threshold: int) -> tuple[int, int]:
    """Keep everything alive after start-up out of every later garbage collection, and collect the youngest
    generation only after `young_threshold` more objects; how many objects were kept out, and the threshold
    it replaced (`thaw_startup_heap` puts it back).

    vLLM's OpenAI server freezes the same way once it is up (`vllm.utils.gc_utils.freeze_gc_heap`, not called
    here: only the vLLM adapter may import vLLM, and this is three lines of the standard library). Without
    it a full collection walks the whole start-up heap (torch, transformers, vLLM: about 600,000
    objects with the tiny model) and holds the event loop 400-550 ms while every stream waits. At Python's
    threshold of 700, a step's outputs for a batch of 128 set off a collection of the youngest generation
    about every 130 tokens, 0.6-0.7 ms each, that walks those outputs while they are still in use
    (`Settings.gc_young_threshold`).
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


class LiveTelemetry:
    """What WatchTelemetry snapshots read (phasescope.serve.watch.TelemetrySource)."""

    def __init__(self, steps: StepAggregator, recent: RecentLatencies) -> None:
        self._steps = steps
        self._recent = recent

    def views(self) -> tuple[float, list[EngineView]]:
        return self._steps.views()

    def latencies(self, window_seconds: float) -> LatencyFigures:
        self._steps.flush_reports()  # the inter-token gaps of the steps it holds
        return self._recent.figures(window_seconds)

    @property
    def rejected(self) -> int:
        return self._recent.rejected
