"""Tracing for the server, built only when an OTLP endpoint is configured.

With tracing off nothing is imported from the SDK, no provider, exporter or
batch thread exists, and no interceptor runs: it costs nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from phasescope.environment import env_otel_service_name, env_otlp_traces_endpoint
from phasescope.serve.config import Settings

logger = logging.getLogger(__name__)

# Probes and tooling call these often; a trace per health check is noise.
UNTRACED_SERVICES = ("grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection")


@dataclass(frozen=True)
class Tracing:
    provider: Any
    """The SDK TracerProvider; shut down at exit to flush."""
    interceptor: grpc.aio.ServerInterceptor
    observer: Any
    """A phasescope.telemetry.request.tracing.TracingObserver."""
    trace_id: Callable[[], str | None]


def build_tracing(settings: Settings) -> Tracing | None:
    # The flag, else the standard OTEL_* variables; empty means tracing is off.
    endpoint = settings.otlp_endpoint or env_otlp_traces_endpoint()
    if not endpoint:
        return None
    from opentelemetry.instrumentation.grpc import aio_server_interceptor, filters

    from phasescope.telemetry.request.tracing import (
        TracingConfig,
        TracingObserver,
        build_tracer_provider,
        current_trace_id,
    )

    config = TracingConfig(
        endpoint=endpoint,
        service_name=settings.otel_service_name or env_otel_service_name() or "phasescope",
        sample_ratio=settings.trace_sample_ratio,
        include_text=settings.trace_include_text,
    )
    provider = build_tracer_provider(config)
    untraced = filters.any_of(*(filters.service_name(name) for name in UNTRACED_SERVICES))
    # The instrumentation package ships without annotations.
    interceptor = aio_server_interceptor(tracer_provider=provider, filter_=filters.negate(untraced))  # type: ignore[no-untyped-call]
    logger.info(
        "tracing to %s as service %r, sampling %.0f%% of new traces%s",
        endpoint,
        config.service_name,
        config.sample_ratio * 100,
        " (with prompt and output text)" if config.include_text else "",
    )
    return Tracing(provider, interceptor, TracingObserver(provider, config.include_text), current_trace_id)
