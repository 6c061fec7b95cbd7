"""OpenTelemetry: one trace per request, with queue, prefill and decode spans placed at the engine's timestamps.

The gRPC server span comes from opentelemetry-instrumentation-grpc's aio
interceptor (its parent is the caller's W3C `traceparent`). Under it,
`TracingObserver` adds a request span whose children tile it, one per stage of
`stages.STAGES` (frontend, intake, then queue, prefill and decode at the engine's own
timestamps, or abandoned for a request that ended before its first token). Each
request's monotonic readings are placed on the wall clock by the offset read at its
own entry (phasescope.telemetry.request.phases).
Attributes follow the GenAI semantic conventions where they exist
(`gen_ai.*`) and `phasescope.*` otherwise. No prompt or output text is
recorded unless text capture is turned on.

Spans leave through a `BatchSpanProcessor` (its own thread): nothing on the
request path waits for the exporter. With tracing off none of this is built.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Status, StatusCode

from phasescope.telemetry.request.adapters import BASE_ADAPTER
from phasescope.telemetry.request.phases import FirstTokenRecord, PhaseRecord, PhaseTimings, stamp_value
from phasescope.telemetry.request.stages import DECODE, KV_TRANSFER, STAGES

INSTRUMENTATION_NAME = "phasescope"


@dataclass(frozen=True, slots=True)
class TracingConfig:
    endpoint: str
    """OTLP/gRPC endpoint, e.g. http://collector:4317."""
    service_name: str
    sample_ratio: float
    include_text: bool = False


def build_tracer_provider(config: TracingConfig, exporter: SpanExporter | None = None) -> TracerProvider:
    """A provider that batches spans to OTLP/gRPC (or to `exporter`, in tests); parents decide sampling first."""
    provider = TracerProvider(
        resource=Resource.create({SERVICE_NAME: config.service_name}),
        sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)),
    )
    if exporter is None:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        insecure = config.endpoint.startswith("http://")
        exporter = OTLPSpanExporter(endpoint=config.endpoint, insecure=insecure)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def current_trace_id() -> str | None:
    """Hex id of the current sampled trace, or None (for exemplars)."""
    context = trace.get_current_span().get_span_context()
    if not context.is_valid or not context.trace_flags.sampled:
        return None
    return format(context.trace_id, "032x")


def _nanoseconds(wall_seconds: float) -> int:
    return round(wall_seconds * 1e9)


def _decode_attributes(timings: PhaseTimings) -> dict[str, float | None]:
    return {
        "phasescope.decode_tokens_per_second": timings.decode_tokens_per_second,
        "phasescope.mean_inter_token_seconds": timings.mean_inter_token_seconds,
        "phasescope.decode_stalled_by_prefill_seconds": timings.decode_stalled_by_prefill_seconds,
        "phasescope.decode_prefill_interference_seconds": timings.decode_prefill_interference_seconds,
        # Under speculative decoding only (None: no attribute).
        "phasescope.speculative_drafted_tokens": timings.speculative_drafted_tokens or None,
        "phasescope.speculative_accepted_tokens": timings.speculative_accepted_tokens or None,
    }


def _no_attributes(timings: PhaseTimings) -> dict[str, float | None]:
    return {}


def _kv_transfer_attributes(timings: PhaseTimings) -> dict[str, float | None]:
    return {
        "phasescope.kv_loaded_tokens": timings.kv_loaded_tokens,
        "phasescope.kv_saved_tokens": timings.kv_saved_tokens,
        "phasescope.kv_transfer_bytes": timings.kv_transfer_bytes,
    }


# What a stage's span carries beside its own seconds.
_EXTRA_ATTRIBUTES: dict[str, Callable[[PhaseTimings], dict[str, float | None]]] = {
    DECODE.name: _decode_attributes,
    KV_TRANSFER.name: _kv_transfer_attributes,
}


class TracingObserver:
    """Turns each finished request's record into a request span with its phase children."""

    def __init__(self, provider: TracerProvider, include_text: bool = False) -> None:
        self._tracer = provider.get_tracer(INSTRUMENTATION_NAME)
        self._include_text = include_text

    def request_started(self, model: str, adapter: str = BASE_ADAPTER) -> None:
        """Spans are built when the request ends, from its timestamps."""

    def request_first_token(self, record: FirstTokenRecord) -> None:
        """The request span carries the first token as an event when it ends."""

    counts_tokens = False
    """`ObserverGroup` leaves this observer out of the per-chunk token calls (the span gets its counts at the end)."""

    def tokens_generated(self, model: str, count: int, adapter: str = BASE_ADAPTER) -> None:
        """Token counts are on the request span."""

    def request_rejected(self, model: str, reason: str, adapter: str = BASE_ADAPTER) -> None:
        """The gRPC server span already carries a rejected request's status."""

    def request_finished(self, record: PhaseRecord) -> None:
        stamps = record.stamps
        front = record.front

        def wall(monotonic: float) -> float | None:
            # 0 means the request never got there.
            return front.wall(monotonic) if monotonic > 0 else None

        entry = front.wall_at_entry
        first_token = wall(stamps.first_token_ts) if stamps else None
        last_token = wall(stamps.last_token_ts) if stamps else None
        ended = wall(front.ended) or entry
        start = entry
        # A finished request ends with its last token; one that failed or was cancelled
        # ends when the front end gave up on it.
        end = last_token if last_token is not None and record.code == "OK" else ended
        end = max(end, start)

        parameters = record.parameters
        span = self._tracer.start_span(
            f"{parameters.operation} {record.model}",
            kind=trace.SpanKind.INTERNAL,
            start_time=_nanoseconds(start),
        )
        attributes: dict[str, str | int | float | list[str]] = {
            "gen_ai.operation.name": parameters.operation,
            "gen_ai.provider.name": "vllm",
            "gen_ai.request.model": record.model,
            "gen_ai.response.model": record.model,
            "gen_ai.usage.input_tokens": record.prompt_tokens,
            "gen_ai.usage.output_tokens": record.completion_tokens,
            # Each sample's, in order (vLLM's OpenAI server reports a request's n choices so).
            "gen_ai.response.finish_reasons": [sample.finish_reason for sample in record.samples]
            or [record.finish_reason],
            "phasescope.status_code": record.code,
            "phasescope.cached_prompt_tokens": record.cached_prompt_tokens,
        }
        if record.samples:
            attributes["gen_ai.request.choice.count"] = len(record.samples)
        if parameters.constraint:
            attributes["phasescope.structured_output"] = parameters.constraint
        if parameters.adapter:
            attributes["phasescope.lora_adapter"] = parameters.adapter
        if parameters.max_tokens is not None:
            attributes["gen_ai.request.max_tokens"] = parameters.max_tokens
        if parameters.temperature is not None:
            attributes["gen_ai.request.temperature"] = parameters.temperature
        if parameters.top_p is not None:
            attributes["gen_ai.request.top_p"] = parameters.top_p
        timings = record.timings
        if timings.time_to_first_token_seconds is not None:
            attributes["phasescope.time_to_first_token_seconds"] = timings.time_to_first_token_seconds
        if timings.e2e_seconds is not None:
            attributes["phasescope.e2e_seconds"] = timings.e2e_seconds
        if timings.client_time_to_first_token_seconds is not None:
            attributes["phasescope.client_time_to_first_token_seconds"] = timings.client_time_to_first_token_seconds
        if self._include_text and record.text is not None:
            attributes["phasescope.prompt"] = record.text.prompt
            attributes["phasescope.output"] = record.text.output
        span.set_attributes(attributes)

        context = trace.set_span_in_context(span)
        starts = [wall(stamp_value(stage.start, front, stamps)) for stage in STAGES]
        # The stages that follow one (kv_transfer lies inside queue or prefill, after nothing).
        later = [start if not stage.nested else None for start, stage in zip(starts, STAGES, strict=True)]
        for index, stage in enumerate(STAGES):
            seconds = timings.seconds(stage)
            phase_start = starts[index]
            if phase_start is None:
                continue  # never reached
            if seconds is None and (stage.only_without_first_token or any(later[index + 1 :])):
                # Not this request's (abandoned, once a first token came), or never left while a
                # later stage began (abandoned stands for intake, queue and prefill when the
                # engine stamped nothing).
                continue
            # A stage the request never left closes when the request ended.
            closed_at = (wall(stamp_value(stage.end, front, stamps)) if seconds is not None else None) or end
            child = self._tracer.start_span(stage.name, context=context, start_time=_nanoseconds(phase_start))
            stage_attributes: dict[str, float | int | None] = {
                f"phasescope.{stage.seconds_field}": seconds,
                **_EXTRA_ATTRIBUTES.get(stage.name, _no_attributes)(timings),
            }
            if stage.name == "prefill":
                # What the prefill did and did not compute: the prefix cache held the rest.
                stage_attributes["phasescope.cached_prompt_tokens"] = record.cached_prompt_tokens
                stage_attributes["phasescope.prefill_tokens_computed"] = record.prefill_tokens_computed
            child.set_attributes({key: value for key, value in stage_attributes.items() if value is not None})
            child.end(end_time=_nanoseconds(max(closed_at, phase_start)))
        if first_token is not None:
            span.add_event("first_token", timestamp=_nanoseconds(first_token))

        if record.code != "OK":
            span.set_status(Status(StatusCode.ERROR, record.code))
            if record.error is not None:
                span.record_exception(record.error, escaped=True)
        span.end(end_time=_nanoseconds(end))
