"""Prometheus implementation of `RequestObserver`: per-request phase figures.

The observer is one collector, registered where the server is wired, so tests register it in a private
`CollectorRegistry`. Names start with `phasescope_` and never contain "vllm"
(vLLM's `unregister_vllm_metrics()` drops any collector whose name does).
Labels stay bounded: model, adapter (phasescope.telemetry.request.adapters), phase, code, finish reason,
rejection reason.
docs/metrics.md documents each series; a test keeps the two in step.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from phasescope.telemetry.children import Children
from phasescope.telemetry.model.cost import ModelCost
from phasescope.telemetry.request.adapters import BASE_ADAPTER
from phasescope.telemetry.request.phases import FirstTokenRecord, PhaseRecord, PhaseTimings
from phasescope.telemetry.request.stages import FRONTEND, INTAKE, STAGES

# Request-level latency: a millisecond (the frontend stage, a queue hop) to two hours
# (a long generation under load), like vLLM's request buckets.
REQUEST_SECONDS_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 5.0,
    7.5, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 3840.0, 7680.0,
)  # fmt: skip


# Which stages each record observes (the table says when each is known).
_AT_FIRST_TOKEN = tuple(stage for stage in STAGES if stage.at_first_token)
_AT_END = tuple(stage for stage in STAGES if not stage.at_first_token and not stage.only_without_first_token)
_WITHOUT_FIRST_TOKEN = tuple(stage for stage in STAGES if stage.without_first_token)
# The stages a request's samples share (frontend, intake) are observed once per request.
_SAMPLE_AT_FIRST_TOKEN = tuple(stage for stage in _AT_FIRST_TOKEN if stage not in (FRONTEND, INTAKE))
_SAMPLE_WITHOUT_FIRST_TOKEN = tuple(stage for stage in _WITHOUT_FIRST_TOKEN if stage not in (FRONTEND, INTAKE))
_PHASE_HELP = (
    "Time a request spent in each stage, on one monotonic clock: "
    + "; ".join(
        f"{stage.name} = {stage.end} - {stage.start}"
        + (" (a request that ended before its first token)" if stage.only_without_first_token else "")
        for stage in STAGES
    )
    + "."
)

# How an admitted request can end before its first token.
_UNANSWERED_CODES = ("CANCELLED", "DEADLINE_EXCEEDED", "UNAVAILABLE", "INTERNAL")


class TokenCounts(Collector):
    """`phasescope_tokens`, a counter by model, adapter and phase kept as plain totals.

    The decode count grows with every streamed chunk of every request: a `Counter` child costs a
    lock and its checks each time, where a dictionary entry costs an addition. Only the event loop
    adds (one writer); a scrape reads a copy of the totals, made in one step, and every total it
    reads is one the loop had reached, so the series never goes down."""

    def __init__(self, documentation: str) -> None:
        self.prefill: dict[tuple[str, str], int] = {}
        """By (model, adapter label)."""
        self.decode: dict[tuple[str, str], int] = {}
        self._documentation = documentation

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily("phasescope_tokens", self._documentation, labels=["model", "adapter", "phase"])
        for phase, totals in (("prefill", self.prefill), ("decode", self.decode)):
            for (model, adapter), total in list(totals.items()):
                family.add_metric([model, adapter, phase], total)
        yield family


class PrometheusRequestObserver(Collector):
    """The request series: one collector, registered by whoever wires it (phasescope.serve.build)."""

    def __init__(self, model: str | None = None) -> None:
        """Makes its series and registers nothing. With `model`, the series the TTFT SLO adds together exist from
        the start (at 0), so its expression evaluates before the first request has missed or even run."""
        self.phase_seconds = Histogram(
            "phasescope_request_phase_seconds",
            _PHASE_HELP,
            ["model", "adapter", "phase"],
            buckets=REQUEST_SECONDS_BUCKETS,
            registry=None,
        )
        self.time_to_first_token_seconds = Histogram(
            "phasescope_time_to_first_token_seconds",
            "First token (engine stamp) - handler entry, per request that produced a token, observed at "
            "its first token. Requests that ended before one are in phasescope_requests_without_first_token_total.",
            ["model", "adapter"],
            buckets=REQUEST_SECONDS_BUCKETS,
            registry=None,
        )
        self.prefix_cache_tokens = Counter(
            "phasescope_prefix_cache_hit_tokens",
            "Prompt tokens the prefix cache served instead of prefill computing them, counted at each sequence's "
            'first token (prefill computed the rest: phasescope_tokens_total{phase="prefill"}).',
            ["model"],
            registry=None,
        )
        self.prefix_cache_flops = Counter(
            "phasescope_prefix_cache_saved_flops",
            "FLOPs on each device the prefix cache saved: the cost model's prefill of the tokens it served "
            "(phasescope_model_flops_total counts only what prefill computed).",
            ["model"],
            registry=None,
        )
        self.cost: ModelCost | None = None
        """The served model's cost, once the engine is up (the saved FLOPs need it)."""
        self.structured_queue_seconds = Histogram(
            "phasescope_structured_output_queue_seconds",
            "The queue stage (scheduled - queued) of requests with a structured output, by its kind, observed "
            "at the first token: vLLM holds such a request until its grammar is compiled, so beside the queue "
            "of all requests this is the wait on grammar compilation (a schema compiled before is cached).",
            ["model", "constraint"],
            buckets=REQUEST_SECONDS_BUCKETS,
            registry=None,
        )
        self.client_time_to_first_token_seconds = Histogram(
            "phasescope_client_time_to_first_token_seconds",
            "First chunk written to the client - handler entry, per streaming request.",
            ["model"],
            buckets=REQUEST_SECONDS_BUCKETS,
            registry=None,
        )
        self.request_duration_seconds = Histogram(
            "phasescope_request_duration_seconds",
            "Last token - handler entry (end-to-end latency), per request that produced a token.",
            ["model", "adapter"],
            buckets=REQUEST_SECONDS_BUCKETS,
            registry=None,
        )
        self.decode_stalled_seconds = Histogram(
            "phasescope_decode_prefill_stall_seconds",
            "Per request that decoded: its decode time spent in engine steps that also carried other requests' "
            "prefill chunks (0 for a request that decoded alone).",
            ["model"],
            buckets=REQUEST_SECONDS_BUCKETS,
            registry=None,
        )
        self.decode_interference_seconds = Histogram(
            "phasescope_decode_prefill_interference_seconds",
            "Per request that decoded: the estimated extra time other requests' prefill chunks cost its decode "
            "(each such step's time - a decode-only step of the same batch on that engine).",
            ["model"],
            buckets=REQUEST_SECONDS_BUCKETS,
            registry=None,
        )
        self.without_first_token = Counter(
            "phasescope_requests_without_first_token",
            "Admitted requests that ended before their first token (cancelled, deadline, failure), "
            "by gRPC status code: the time-to-first-token SLO counts each as a miss.",
            ["model", "adapter", "code"],
            registry=None,
        )
        self.tokens = TokenCounts(
            "Tokens per phase, counted as they happen: prefill = prompt tokens computed (prefix-cache hits "
            "excluded), at the first token; decode = output tokens, as they stream.",
        )
        self._decode_tokens = self.tokens.decode
        self.requests = Counter(
            "phasescope_requests",
            "Admitted requests that ended, by gRPC status code and finish reason.",
            ["model", "adapter", "code", "finish_reason"],
            registry=None,
        )
        self.requests_in_flight = Gauge(
            "phasescope_requests_in_flight",
            "Admitted requests not yet ended (running in the engine or waiting in its queue).",
            ["model", "adapter"],
            registry=None,
        )
        self.kv_transfer_tokens = Counter(
            "phasescope_kv_transfer_tokens",
            "Prompt tokens whose KV cache the worker's KV connector moved, by direction: loaded (computed by "
            "another worker: vLLM's external_kv_transfer source) or saved (computed here for another).",
            ["model", "direction"],
            registry=None,
        )
        self.kv_transfer_bytes = Counter(
            "phasescope_kv_transfer_bytes",
            "KV cache bytes the worker's KV connector moved for requests, both directions.",
            ["model"],
            registry=None,
        )
        self.requests_rejected = Counter(
            "phasescope_requests_rejected",
            "Requests refused before reaching the engine, by reason.",
            ["model", "adapter", "reason"],
            registry=None,
        )
        self._child = Children()
        # What `collect` yields, in this order.
        self._series: tuple[Collector, ...] = (
            self.phase_seconds,
            self.time_to_first_token_seconds,
            self.prefix_cache_tokens,
            self.prefix_cache_flops,
            self.structured_queue_seconds,
            self.client_time_to_first_token_seconds,
            self.request_duration_seconds,
            self.decode_stalled_seconds,
            self.decode_interference_seconds,
            self.without_first_token,
            self.tokens,
            self.requests,
            self.requests_in_flight,
            self.kv_transfer_tokens,
            self.kv_transfer_bytes,
            self.requests_rejected,
        )
        if model is not None:
            self.time_to_first_token_seconds.labels(model, BASE_ADAPTER)
            self.decode_stalled_seconds.labels(model)
            self.decode_interference_seconds.labels(model)
            for code in _UNANSWERED_CODES:
                self.without_first_token.labels(model, BASE_ADAPTER, code)

    def describe(self) -> Iterator[Metric]:
        """Every family it exports, by name, for a registry's checks and its filtered scrapes (`name[]`)."""
        return self.collect()

    def collect(self) -> Iterator[Metric]:
        for series in self._series:
            yield from series.collect()

    def request_started(self, model: str, adapter: str = BASE_ADAPTER) -> None:
        self._child(self.requests_in_flight, model, adapter).inc()

    def request_first_token(self, record: FirstTokenRecord) -> None:
        model, adapter = record.model, record.adapter
        timings = record.timings
        # With tracing on, each observation links to its request's trace (shown when
        # the scrape asks for OpenMetrics), so a slow bucket in Grafana opens its trace.
        exemplar = {"trace_id": record.trace_id} if record.trace_id else None
        prefill, key = self.tokens.prefill, (model, adapter)
        prefill[key] = prefill.get(key, 0) + record.prefill_tokens_computed
        if record.cached_prompt_tokens:
            self._child(self.prefix_cache_tokens, model).inc(record.cached_prompt_tokens)
            if self.cost is not None:
                self._child(self.prefix_cache_flops, model).inc(self.cost.prefill_flops(record.cached_prompt_tokens))
        # A request's samples share its frontend and intake stages (observed once); queue, prefill and
        # the first token are each sample's own sequence's, as vLLM's series observe each.
        for stage in _AT_FIRST_TOKEN if record.request_first else _SAMPLE_AT_FIRST_TOKEN:
            seconds = timings.seconds(stage)
            if seconds is not None:
                self._child(self.phase_seconds, model, adapter, stage.name).observe(seconds, exemplar)
        if timings.time_to_first_token_seconds is not None:
            self._child(self.time_to_first_token_seconds, model, adapter).observe(
                timings.time_to_first_token_seconds, exemplar
            )
        if record.constraint and timings.queue_seconds is not None:
            self._child(self.structured_queue_seconds, model, record.constraint).observe(
                timings.queue_seconds, exemplar
            )
        if record.request_first and record.streaming and timings.client_time_to_first_token_seconds is not None:
            self._child(self.client_time_to_first_token_seconds, model).observe(
                timings.client_time_to_first_token_seconds, exemplar
            )

    def tokens_generated(self, model: str, count: int, adapter: str = BASE_ADAPTER) -> None:
        # Called for every chunk of every stream: an addition to a plain total (TokenCounts).
        decode, key = self._decode_tokens, (model, adapter)
        decode[key] = decode.get(key, 0) + count

    def request_finished(self, record: PhaseRecord) -> None:
        model, adapter = record.model, record.adapter
        self._child(self.requests_in_flight, model, adapter).dec()
        self._child(self.requests, model, adapter, record.code, record.finish_reason).inc()
        exemplar = {"trace_id": record.trace_id} if record.trace_id else None
        answered = record.produced_first_token or any(sample.produced_first_token for sample in record.samples)
        if not answered:
            # Its first token never came: the client got nothing, whatever the reason.
            self._child(self.without_first_token, model, adapter, record.code).inc()
        timings = record.timings
        if timings.kv_loaded_tokens:
            self._child(self.kv_transfer_tokens, model, "loaded").inc(timings.kv_loaded_tokens)
        if timings.kv_saved_tokens:
            self._child(self.kv_transfer_tokens, model, "saved").inc(timings.kv_saved_tokens)
        if timings.kv_transfer_bytes:
            self._child(self.kv_transfer_bytes, model).inc(timings.kv_transfer_bytes)
        # The shared stages were observed with the first token, if one came.
        self._observe_sequence(
            model, adapter, record.timings, record.produced_first_token, exemplar, shared=not answered
        )
        # With n samples, each later one's own sequence too (its decode, duration, interference).
        for sample in record.samples[1:]:
            self._observe_sequence(model, adapter, sample.timings, sample.produced_first_token, exemplar, shared=False)

    def _observe_sequence(
        self,
        model: str,
        adapter: str,
        timings: PhaseTimings,
        answered: bool,
        exemplar: dict[str, str] | None,
        *,
        shared: bool,
    ) -> None:
        """One sequence's stages at its end; `shared`: the request's first, which also observes the stages
        its samples share (a request without a first token observes its frontend stage here)."""
        stages = _AT_END if answered else (_WITHOUT_FIRST_TOKEN if shared else _SAMPLE_WITHOUT_FIRST_TOKEN)
        for stage in stages:
            seconds = timings.seconds(stage)
            if seconds is not None:
                self._child(self.phase_seconds, model, adapter, stage.name).observe(seconds, exemplar)
        if not answered:
            return
        if timings.decode_stalled_by_prefill_seconds is not None:
            self._child(self.decode_stalled_seconds, model).observe(timings.decode_stalled_by_prefill_seconds, exemplar)
        if timings.decode_prefill_interference_seconds is not None:
            self._child(self.decode_interference_seconds, model).observe(
                timings.decode_prefill_interference_seconds, exemplar
            )
        if timings.e2e_seconds is not None:
            self._child(self.request_duration_seconds, model, adapter).observe(timings.e2e_seconds, exemplar)

    def request_rejected(self, model: str, reason: str, adapter: str = BASE_ADAPTER) -> None:
        self._child(self.requests_rejected, model, adapter, reason).inc()
