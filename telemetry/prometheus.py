"""Prometheus implementation of `RequestObserver`: per-request phase figures.

Every metric is registered in the registry passed in, so tests use a private
`CollectorRegistry`. Names start with `phasescope_` and never contain "vllm"
(vLLM's `unregister_vllm_metrics()` drops any collector whose name does).
Labels stay bounded: model, phase, code, finish reason, rejection reason.
docs/metrics.md documents each series; a test keeps the two in step.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from telemetry.phases import PhaseRecord

# Request-level latency: milliseconds (a queue hop) to two hours (a long
# generation under load), like vLLM's request buckets.
REQUEST_SECONDS_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 5.0,
    7.5, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 3840.0, 7680.0,
)  # fmt: skip
# Gaps between tokens: sub-millisecond on a GPU to seconds on a loaded CPU.
INTER_TOKEN_SECONDS_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
    0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip


class PrometheusRequestObserver:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.phase_seconds = Histogram(
            "phasescope_request_phase_seconds",
            "Time a request spent in each phase, from the engine's timestamps: "
            "queue = scheduled - queued, prefill = first token - scheduled, decode = last token - first token.",
            ["model", "phase"],
            buckets=REQUEST_SECONDS_BUCKETS,
            registry=registry,
        )
        self.time_to_first_token_seconds = Histogram(
            "phasescope_time_to_first_token_seconds",
            "First token - arrival, per request.",
            ["model"],
            buckets=REQUEST_SECONDS_BUCKETS,
            registry=registry,
        )
        self.inter_token_latency_seconds = Histogram(
            "phasescope_inter_token_latency_seconds",
            "Each gap between consecutive output tokens of a request, on the engine's clock.",
            ["model"],
            buckets=INTER_TOKEN_SECONDS_BUCKETS,
            registry=registry,
        )
        self.request_duration_seconds = Histogram(
            "phasescope_request_duration_seconds",
            "Last token - arrival (end-to-end latency), per request that produced a token.",
            ["model"],
            buckets=REQUEST_SECONDS_BUCKETS,
            registry=registry,
        )
        self.tokens = Counter(
            "phasescope_tokens",
            "Tokens processed per phase: prefill = prompt tokens computed (prefix-cache hits excluded), "
            "decode = output tokens generated.",
            ["model", "phase"],
            registry=registry,
        )
        self.requests = Counter(
            "phasescope_requests",
            "Admitted requests that ended, by gRPC status code and finish reason.",
            ["model", "code", "finish_reason"],
            registry=registry,
        )
        self.requests_in_flight = Gauge(
            "phasescope_requests_in_flight",
            "Admitted requests not yet ended (running in the engine or waiting in its queue).",
            ["model"],
            registry=registry,
        )
        self.requests_rejected = Counter(
            "phasescope_requests_rejected",
            "Requests refused before reaching the engine, by reason.",
            ["model", "reason"],
            registry=registry,
        )

    def request_started(self, model: str) -> None:
        self.requests_in_flight.labels(model).inc()

    def request_finished(self, record: PhaseRecord) -> None:
        model = record.model
        self.requests_in_flight.labels(model).dec()
        self.requests.labels(model, record.code, record.finish_reason).inc()
        self.tokens.labels(model, "prefill").inc(record.prefill_tokens_computed)
        self.tokens.labels(model, "decode").inc(record.completion_tokens)
        timings = record.timings
        # With tracing on, each observation links to its request's trace (shown when
        # the scrape asks for OpenMetrics), so a slow bucket in Grafana opens its trace.
        exemplar = {"trace_id": record.trace_id} if record.trace_id else None
        for phase, seconds in (
            ("queue", timings.queue_seconds),
            ("prefill", timings.prefill_seconds),
            ("decode", timings.decode_seconds),
        ):
            if seconds is not None:
                self.phase_seconds.labels(model, phase).observe(seconds, exemplar)
        if timings.time_to_first_token_seconds is not None:
            self.time_to_first_token_seconds.labels(model).observe(timings.time_to_first_token_seconds, exemplar)
        if timings.e2e_seconds is not None:
            self.request_duration_seconds.labels(model).observe(timings.e2e_seconds, exemplar)
        inter_token = self.inter_token_latency_seconds.labels(model)
        for gap in record.inter_token_seconds:
            inter_token.observe(gap)

    def request_rejected(self, model: str, reason: str) -> None:
        self.requests_rejected.labels(model, reason).inc()
