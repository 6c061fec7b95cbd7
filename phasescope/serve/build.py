"""The composition root: every part of a server, wired in one place (nothing listens, no engine starts).

`build_server(settings)` makes what does not depend on the engine (the telemetry pipeline, the observers,
the request path, both protocols' handlers, health, reflection, the interceptors, the gRPC server, not yet
started). Once the engine has started, `Built.decide_for(engine)` decides what it brings (the peaks each engine
is judged against, whether the front end is pinned, its GPUs' counters) and `Built.attach_engine(engine, peaks)`
wires it: the step aggregator, its series, then one `Attached` (the engine, its interference totals, the
server's facts, the live telemetry) set on the request path, where both protocols' handlers read it.
`phasescope.serve.app.Server` starts, serves and stops what this built; tests build their servers here too, so
they exercise what production wires.

From a request or an engine step to a Prometheus sample, as wired here:

    InferenceServicer ──┐
    VllmEngineServicer ─┴▶ RequestPath ─▶ RequestLifecycle ─▶ ObserverGroup ─┬─▶ tracing's observer: every call
                           (FirstTokenRecord, PhaseRecord, each once)         │   at once
                                                                              └─▶ PrometheusRequestObserver,
                                                                                  RecentLatencies: the records
                                                                                  held, the counts at once
    each engine core's scheduler ─▶ StepHub ─▶ StepForwarder ─▶ StepAggregator ─┬─▶ interference ledger, at once
                                                                                └─▶ held: the window, then the
                                                                                    sinks RecentLatencies, StepMetrics
    vLLM's own series (its Prometheus logger) ─▶ held
    held: in the TelemetryPipeline, in the order they came, handed on once 96 are held and no request waits for
          its first token (at most 1 s later), and before every read: a scrape (its hook), the live view, GetLoads
    the registry, in order: telemetry errors, the pipeline's hook, the request series (build_server), the step
          series, the GPU counters (attach_engine) ─▶ /metrics

A LoRA adapter rides both routes: the request path labels each request once it is decoded (one `AdapterLabels`,
bounded by --max-adapter-labels), and its records carry that label to the request series; each step's report
names the adapters it ran by their engine ids, which the aggregator reads through the engine's
`ModelDescription.adapters_by_id` into the step's bytes and FLOPs and the adapter series of `StepMetrics` (under the
same labels).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import REGISTRY, CollectorRegistry

from phasescope.engine.base import Engine, ModelDescription
from phasescope.environment import env_auth_tokens, env_cuda_devices
from phasescope.serve.admission import Admission
from phasescope.serve.auth import BearerTokenInterceptor, caller_identity, load_tokens
from phasescope.serve.config import Settings
from phasescope.serve.engine_protocol.servicer import SERVICE_NAME as ENGINE_PROTOCOL_SERVICE
from phasescope.serve.engine_protocol.servicer import VllmEngineServicer, engine_protocol_handler
from phasescope.serve.inference import SERVICE_NAME, InferenceServicer, inference_handler
from phasescope.serve.interceptors import ExceptionToStatusInterceptor
from phasescope.serve.path import Attached, RequestPath
from phasescope.serve.peaks import engine_cost_per_hour, per_engine_peaks, resolve_peaks, with_memory_capacity
from phasescope.serve.tracing_setup import Tracing, build_tracing
from phasescope.serve.watch import ServerFacts
from phasescope.telemetry.errors import TelemetryErrors
from phasescope.telemetry.hardware.gpu_counters import GpmSampler, gpm_sampler
from phasescope.telemetry.hardware.peaks import HardwarePeaks
from phasescope.telemetry.live import LatencyFigures, RecentLatencies
from phasescope.telemetry.model.speculation import Drafter
from phasescope.telemetry.pipeline import FirstTokenWaits, TelemetryPipeline
from phasescope.telemetry.request.adapters import AdapterLabels
from phasescope.telemetry.request.observer import ObserverGroup, RequestObserver
from phasescope.telemetry.request.prometheus import PrometheusRequestObserver
from phasescope.telemetry.step.aggregator import EngineView, StepAggregator, StepSink
from phasescope.telemetry.step.prometheus import StepMetrics
from phasescope.telemetry.step.records import StepForwarder
from phasescope.telemetry.step.verdict import HeadroomLimits

logger = logging.getLogger(__name__)

HEALTH_SERVICE: str = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
# gRPC allows 4 MiB requests by default; a context window of text fits easily.
MAX_MESSAGE_BYTES = 16 * 2**20
GRPC_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # A gateway pings every connection (smg every 30 s), also between requests and while a unary Generate writes
    # nothing: a default server counts those as strikes and ends the connection with GOAWAY(too_many_pings). As
    # vLLM's own gRPC worker allows them.
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
)


async def _nothing() -> None:
    return None


class LiveTelemetry:
    """What WatchTelemetry snapshots and GetLoads read (phasescope.serve.watch.TelemetrySource)."""

    def __init__(self, steps: StepAggregator, recent: RecentLatencies, pipeline: TelemetryPipeline) -> None:
        self._steps = steps
        self._recent = recent
        self._pipeline = pipeline

    def views(self) -> tuple[float, list[EngineView]]:
        return self._steps.views()

    def latencies(self, window_seconds: float) -> LatencyFigures:
        # The steps' pipeline (the hub's, beside smg's Rust server) and this server's.
        self._steps.hand_on()
        self._pipeline.hand_on()
        return self._recent.figures(window_seconds)

    @property
    def rejected(self) -> int:
        return self._recent.rejected


def step_aggregator(
    settings: Settings,
    description: ModelDescription,
    peaks: HardwarePeaks,
    sinks: tuple[StepSink, ...],
    pipeline: TelemetryPipeline,
    on_error: Callable[[str, BaseException], None],
) -> StepAggregator:
    """The engine's steps judged against `peaks` (each engine's), as the settings say to judge them."""
    return StepAggregator(
        description.cost,
        description.dtype,
        peaks,
        engines=description.data_parallel_size,
        window_seconds=settings.metrics_window_seconds,
        headroom_limits=HeadroomLimits(
            bandwidth=settings.headroom_bandwidth,
            compute=settings.headroom_compute,
            kv_cache=settings.headroom_kv_cache,
            queue=settings.headroom_queue,
        ),
        cost_per_hour=engine_cost_per_hour(settings, description),
        sinks=sinks,
        kv_cache_capacity_tokens=description.kv_cache_capacity_tokens,
        pipeline=pipeline,
        on_error=on_error,
        drafter=Drafter(tokens=speculative.num_speculative_tokens, model=speculative.draft_cost)
        if (speculative := description.speculative) is not None
        else None,
        adapters=description.adapters_by_id,
    )


def judged_against(settings: Settings, description: ModelDescription) -> HardwarePeaks:
    """The peaks each engine is judged against (datasheet, flags or a probe), logged once. Blocking: a probe
    measures the machine."""
    peaks = resolve_peaks(settings, description.device, description.on_cpu, description.dtype)
    # On a CPU the engine cores share the machine's cores and memory.
    engine_peaks = with_memory_capacity(
        per_engine_peaks(peaks, settings, description.data_parallel_size, description.on_cpu), description
    )
    bandwidth = engine_peaks.memory_bandwidth_bytes_per_second
    flops = engine_peaks.peak_flops(description.dtype)
    logger.info(
        "judging utilisation against %s peaks of %s: %.3g GB/s, %.3g TFLOP/s %s (ridge %.1f FLOP/byte)",
        peaks.source,
        peaks.description or peaks.device,
        bandwidth / 1e9,
        flops / 1e12,
        description.dtype,
        flops / bandwidth,
    )
    return engine_peaks


@dataclass(frozen=True)
class EngineDecisions:
    """What is decided once the engine has started and said what it is (`Built.decide_for`); the server acts on
    it (`phasescope.serve.app.Server`) and `Built.attach_engine` wires it."""

    peaks: HardwarePeaks
    """The peaks each engine is judged against."""
    pin_front_end: bool
    """Move the front end and the engine core off the CPUs the engine's workers compute on (an engine on the CPU,
    with --pin-front-end); after the peaks, which a probe measures on the whole machine."""
    gpu_counters: GpmSampler | None
    """NVML's measured counters of the engine's GPUs (None: on a CPU, or no GPU supports them); not sampling yet."""


@dataclass
class Built:
    """A server's parts, wired; the gRPC server is not started."""

    settings: Settings
    model_name: str
    registry: CollectorRegistry
    grpc: grpc.aio.Server
    health: health.aio.HealthServicer
    pipeline: TelemetryPipeline
    steps: StepForwarder
    """Where the engine cores' step reports go (to the aggregator, once the engine is attached)."""
    path: RequestPath
    inference: InferenceServicer
    engine_protocol: VllmEngineServicer
    request_metrics: PrometheusRequestObserver
    recent: RecentLatencies
    telemetry_errors: TelemetryErrors
    tracing: Tracing | None
    started: float = field(default_factory=time.monotonic)
    aggregator: StepAggregator | None = None

    def decide_for(self, engine: Engine) -> EngineDecisions:
        """What a started engine brings beside its requests: the peaks it is judged against, where the front end
        runs, its GPUs' measured counters. Blocking (a probe measures, NVML loads): the server calls it on a
        worker thread."""
        description = engine.description
        return EngineDecisions(
            peaks=judged_against(self.settings, description),
            pin_front_end=description.on_cpu and self.settings.pin_front_end,
            gpu_counters=None if description.on_cpu else gpm_sampler(self.model_name, environ=env_cuda_devices()),
        )

    def attach_engine(
        self,
        engine: Engine,
        peaks: HardwarePeaks,
        *,
        steps_from: StepAggregator | None = None,
        recent: RecentLatencies | None = None,
        gpu_counters: GpmSampler | None = None,
    ) -> StepAggregator:
        """Wire a started engine in: its steps judged against `peaks` (each engine's), its requests served.

        `steps_from`: the engine's steps are aggregated elsewhere already (the hub's, beside smg's Rust server),
        with `recent` the latencies it keeps; this server reads them and aggregates none of its own.
        `gpu_counters`: its GPUs' measured counters, whose series are registered after the steps'."""
        description = engine.description
        aggregator = steps_from
        if aggregator is None:
            aggregator = step_aggregator(
                self.settings, description, peaks, (self.recent,), self.pipeline, self.telemetry_errors
            )
            step_metrics = StepMetrics(self.model_name, aggregator, self.path.adapter_labels.label)
            aggregator.add_sink(step_metrics)
            self.registry.register(step_metrics)
            self.steps.attach(aggregator.record)
        if gpu_counters is not None:
            self.registry.register(gpu_counters)
        self.request_metrics.cost = description.cost  # what a prefix-cache hit saves, in FLOPs
        self.path.attach(
            Attached(
                engine,
                interference=aggregator.interference.read,
                facts=ServerFacts(self.model_name, description.device, description.dtype, peaks, self.started),
                telemetry=LiveTelemetry(aggregator, recent or self.recent, self.pipeline),
            )
        )
        self.aggregator = aggregator
        return aggregator

    async def set_health(self, status: int) -> None:
        for service in ("", SERVICE_NAME):
            await self.health.set(service, status)


def build_server(
    settings: Settings,
    model_name: str,
    *,
    registry: CollectorRegistry = REGISTRY,
    on_engine_dead: Callable[[], Awaitable[None]] = _nothing,
    engine: Engine | None = None,
    peaks: HardwarePeaks | None = None,
) -> Built:
    """Every part of a server for `settings`, its model served as `model_name`; with `engine` (and its `peaks`)
    the engine is attached too. `on_engine_dead` is awaited once when a request finds the engine dead."""
    telemetry_errors = TelemetryErrors(model_name)
    registry.register(telemetry_errors)
    waits = FirstTokenWaits()
    pipeline = TelemetryPipeline(waits, on_error=telemetry_errors)
    # First: a registry collects in registration order, and a scrape hands on what is held before the series.
    registry.register(pipeline.scrape_hook())
    tracing = build_tracing(settings)
    recent = RecentLatencies()
    request_metrics = PrometheusRequestObserver(model_name)
    registry.register(request_metrics)
    direct: list[RequestObserver] = [tracing.observer] if tracing is not None else []
    records = ObserverGroup(direct, [request_metrics, recent], pipeline=pipeline, on_error=telemetry_errors)
    tokens = load_tokens(settings.auth_tokens_file, env_auth_tokens())
    path = RequestPath(
        records,
        Admission(settings.max_concurrent_requests, settings.max_queued_requests, settings.max_requests_per_client),
        model_name,
        first_token_waits=waits,
        trace_id=tracing.trace_id if tracing is not None else lambda: None,
        capture_text=tracing is not None and settings.trace_include_text,
        identify=functools.partial(caller_identity, tokens_checked=bool(tokens)),
        on_engine_dead=on_engine_dead,
        adapter_labels=AdapterLabels(settings.max_adapter_labels),
    )
    inference = InferenceServicer(
        path, max_watchers=settings.max_watchers, allow_adapter_updates=settings.allow_adapter_updates
    )
    # vLLM's engine protocol on the same port, over the same path: the smg gateway's door.
    engine_protocol = VllmEngineServicer(path)

    # Listed outermost first: authentication, then the server span, which wraps the status mapping so it sees
    # the final status.
    interceptors: list[grpc.aio.ServerInterceptor] = []
    if tokens:
        exempt = (HEALTH_SERVICE, reflection.SERVICE_NAME) if settings.auth_exempt_health else ()
        interceptors.append(BearerTokenInterceptor(tokens, exempt))
        logger.info("bearer-token authentication on (%d tokens)%s", len(tokens), "; health open" if exempt else "")
    if tracing is not None:
        interceptors.append(tracing.interceptor)
    interceptors.append(ExceptionToStatusInterceptor((SERVICE_NAME, ENGINE_PROTOCOL_SERVICE)))
    server = grpc.aio.server(interceptors=interceptors, options=list(GRPC_OPTIONS))
    server.add_generic_rpc_handlers((inference_handler(inference), engine_protocol_handler(engine_protocol)))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, ENGINE_PROTOCOL_SERVICE, HEALTH_SERVICE, reflection.SERVICE_NAME), server
    )
    built = Built(
        settings=settings,
        model_name=model_name,
        registry=registry,
        grpc=server,
        health=health_servicer,
        pipeline=pipeline,
        steps=StepForwarder(on_error=telemetry_errors),
        path=path,
        inference=inference,
        engine_protocol=engine_protocol,
        request_metrics=request_metrics,
        recent=recent,
        telemetry_errors=telemetry_errors,
        tracing=tracing,
    )
    if engine is not None:
        if peaks is None:
            raise ValueError("an engine is attached with the peaks it is judged against")
        built.attach_engine(engine, peaks)
    return built
