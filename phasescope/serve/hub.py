"""phasescope's physics for an engine whose request path is not phasescope's: the telemetry hub on its own.

The engine cores report every step and every request where they happen (phasescope.engine.vllm.core_telemetry);
a hub receives them. Behind phasescope's own request path the hub feeds the server `build_server` wires. Behind a
front end phasescope does not run — smg's Rust request path (`--front-end rust`), vLLM's OpenAI server or any
other (`--front-end external`) — `HubTelemetry` is the whole of phasescope: the hub, the step aggregator and its
series, the engine-side request series (`phasescope.telemetry.request.engine_side`), and /metrics. What judges
the steps (the model's cost, the device, the KV cache) comes from the engine cores' own facts, with their first
batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from phasescope.engine.base import ModelDescription, Speculative
from phasescope.serve.build import judged_against, step_aggregator
from phasescope.serve.config import Settings
from phasescope.telemetry.endpoint import start_metrics_server
from phasescope.telemetry.errors import TelemetryErrors
from phasescope.telemetry.live import RecentLatencies
from phasescope.telemetry.pipeline import TelemetryPipeline
from phasescope.telemetry.request.engine_side import EngineSideRequests, RecordClaims
from phasescope.telemetry.request.prometheus import PrometheusRequestObserver
from phasescope.telemetry.step.aggregator import StepAggregator
from phasescope.telemetry.step.prometheus import StepMetrics
from phasescope.telemetry.step.records import EngineFacts, StepForwarder, StepReport
from phasescope.telemetry.step.transport import StepHub

logger = logging.getLogger(__name__)


def description_of(facts: EngineFacts) -> ModelDescription:
    """What the engine cores said of themselves, as the description the step telemetry reads."""
    speculative = None
    if facts.speculative_tokens:
        speculative = Speculative(
            method="", num_speculative_tokens=facts.speculative_tokens, draft_cost=facts.draft_cost
        )
    return ModelDescription(
        model_name=facts.model_name,
        model_path=facts.model_path,
        max_context_length=0,
        dtype=facts.dtype,
        vocab_size=0,
        engine="vllm",
        engine_version="",
        device=facts.device,
        data_parallel_size=facts.data_parallel_size,
        tensor_parallel_size=facts.tensor_parallel_size,
        pipeline_parallel_size=facts.pipeline_parallel_size,
        cost=facts.cost,
        on_cpu=facts.on_cpu,
        max_num_seqs=facts.max_num_seqs,
        kv_cache_capacity_tokens=facts.kv_cache_capacity_tokens,
        speculative=speculative,
    )


@dataclass
class HubTelemetry:
    """The hub and what it feeds once the engine cores have said what they are."""

    settings: Settings
    registry: CollectorRegistry
    steps: StepForwarder
    pipeline: TelemetryPipeline
    hub: StepHub | None = None
    metrics_port: int = 0
    aggregator: StepAggregator | None = None
    description: ModelDescription | None = None
    errors: TelemetryErrors | None = None
    """Where contained telemetry errors are counted, once the model's name is known."""
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once the step series are wired (the engine cores' first facts arrived and the peaks are resolved)."""
    claims: RecordClaims = field(default_factory=RecordClaims)
    """The engine records a front end of this process waits for (phasescope.v1 beside the Rust server)."""
    recent: RecentLatencies = field(default_factory=RecentLatencies)
    """Every request's and step's recent latencies, from the engine side (what WatchTelemetry and GetLoads read)."""
    _attaching: asyncio.Task[None] | None = None

    @property
    def endpoint(self) -> str:
        """Where the engine cores publish (`PHASESCOPE_TELEMETRY_ENDPOINT`)."""
        return self.hub.endpoint if self.hub is not None else ""

    def contained(self, component: str, exc: BaseException) -> None:
        """A telemetry error contained: counted once the series exist, logged before."""
        if self.errors is not None:
            self.errors(component, exc)
        else:
            logger.warning("telemetry error (%s) before the engine cores said what they are: %s", component, exc)

    def engine_facts(self, facts: EngineFacts) -> None:
        """An engine core's facts (on the event loop): the first wire the series; later ones are repeats."""
        if self._attaching is None:
            self._attaching = asyncio.get_running_loop().create_task(self._attach(facts))

    async def _attach(self, facts: EngineFacts) -> None:
        settings = self.settings
        description = description_of(facts)
        try:
            # As behind phasescope's own request path; a device without the served dtype's figure is refused here.
            engine_peaks = await asyncio.to_thread(judged_against, settings, description)
        except ValueError as exc:  # NoPeakFlopsError and the flags' own refusals are ValueErrors
            logger.error(
                "no step series for %s on %s: %s (give --hardware, or --peak-memory-bandwidth and --peak-flops)",
                facts.model_name,
                facts.device,
                exc,
            )
            return
        model = facts.model_name
        self.errors = errors = TelemetryErrors(model)
        self.registry.register(errors)
        request_metrics = PrometheusRequestObserver(model)
        self.registry.register(request_metrics)
        request_metrics.cost = facts.cost  # what a prefix-cache hit saves, in FLOPs
        requests = EngineSideRequests(model, (request_metrics, self.recent))
        aggregator = step_aggregator(
            settings, description, engine_peaks, (requests, self.recent), self.pipeline, errors
        )
        step_metrics = StepMetrics(model, aggregator)
        aggregator.add_sink(step_metrics)
        self.registry.register(step_metrics)
        self.aggregator, self.description = aggregator, description
        # On the hub's own thread: no request path reads the engine's totals on the event loop here, and a scrape
        # hands on what is held under the pipeline's lock (one thread hop and one loop wake-up less per message).
        self.steps.attach(self._recorder(aggregator), on_loop=False)
        logger.info("step telemetry for %s on %s (%d engine cores)", model, facts.device, facts.data_parallel_size)
        self.ready.set()

    def _recorder(self, aggregator: StepAggregator) -> Callable[[StepReport], None]:
        """Each report to the aggregator, its finished requests' records first to whoever waits for them."""
        offer, record = self.claims.offer, aggregator.record

        def recorded(report: StepReport) -> None:
            for finished in report.finished:
                offer(finished)
            record(report)

        return recorded


@contextlib.asynccontextmanager
async def hub_telemetry(settings: Settings, registry: CollectorRegistry) -> AsyncIterator[HubTelemetry]:
    """The hub bound at `--telemetry-listen` (empty: a private ipc path) and /metrics listening, until the block
    ends; the engine cores' reports reach the series from their first facts on."""
    loop = asyncio.get_running_loop()
    telemetry = HubTelemetry(settings, registry, StepForwarder(), TelemetryPipeline())
    steps, pipeline = telemetry.steps, telemetry.pipeline
    steps.on_error = pipeline.on_error = telemetry.contained
    # First: a registry collects in registration order, and a scrape hands on what is held before the series.
    registry.register(pipeline.scrape_hook())

    def on_facts(facts: EngineFacts) -> None:
        loop.call_soon_threadsafe(telemetry.engine_facts, facts)

    hub = StepHub(steps.report_batch, settings.effective_telemetry_listen, on_error=steps.failed, on_facts=on_facts)
    telemetry.hub = hub.start()
    metrics_server, metrics_thread = start_metrics_server(
        settings.metrics_port, settings.effective_metrics_host, registry
    )
    try:
        logger.info(
            "telemetry hub listening on %s; metrics on http://%s:%d/metrics",
            hub.endpoint,
            settings.effective_metrics_host,
            metrics_server.server_port,
        )
        telemetry.metrics_port = metrics_server.server_port
        yield telemetry
    finally:
        if telemetry._attaching is not None:
            telemetry._attaching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await telemetry._attaching
        await asyncio.to_thread(hub.close)
        pipeline.hand_on()
        metrics_server.shutdown()
        metrics_server.server_close()
        metrics_thread.join(5.0)
