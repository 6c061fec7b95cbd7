import asyncio
import threading

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from telemetry.phases import (
    EngineTimestamps,
    PhaseRecord,
    RequestParameters,
    RequestText,
    derive_phase_timings,
)
from telemetry.tracing import TracingObserver, current_trace_id

OFFSET = 1_700_000_000.0  # wall = engine monotonic + OFFSET
STAMPS = EngineTimestamps(
    arrival_time=99.990 + OFFSET, queued_ts=100.0, scheduled_ts=100.25, first_token_ts=100.75, last_token_ts=102.0
)
MARKER = "zebra-marker-4711"


def record(**overrides: object) -> PhaseRecord:
    values: dict[str, object] = {
        "model": "tiny",
        "code": "OK",
        "finish_reason": "length",
        "prompt_tokens": 7,
        "cached_prompt_tokens": 0,
        "completion_tokens": 6,
        "timings": derive_phase_timings(STAMPS, 6, OFFSET),
        "stamps": STAMPS,
        "wall_offset_seconds": OFFSET,
        "ended_wall_time": 102.001 + OFFSET,
        "parameters": RequestParameters("chat", max_tokens=6, temperature=0.5, top_p=0.9),
        "text": RequestText(f"prompt {MARKER}", f"output {MARKER}"),
    }
    values.update(overrides)
    return PhaseRecord(**values)  # type: ignore[arg-type]


@pytest.fixture
def traced() -> tuple[TracerProvider, InMemorySpanExporter]:
    provider = TracerProvider()
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def finish_under_server_span(provider: TracerProvider, observer: TracingObserver, finished: PhaseRecord) -> None:
    with provider.get_tracer("test").start_as_current_span("server"):
        observer.request_finished(finished)


def by_name(spans: tuple[ReadableSpan, ...]) -> dict[str, ReadableSpan]:
    return {span.name: span for span in spans}


def test_request_span_has_three_phase_children_tiling_it(traced: tuple[TracerProvider, InMemorySpanExporter]) -> None:
    provider, exporter = traced
    finished = record()
    finish_under_server_span(provider, TracingObserver(provider), finished)
    spans = by_name(exporter.get_finished_spans())
    request, server = spans["chat tiny"], spans["server"]
    assert request.parent is not None
    assert request.parent.span_id == server.context.span_id
    children = sorted(
        (s for s in spans.values() if s.parent and s.parent.span_id == request.context.span_id),
        key=lambda s: s.start_time or 0,
    )
    assert [c.name for c in children] == ["queue", "prefill", "decode"]
    queue, prefill, decode = children
    # Engine timestamps moved onto the wall clock: they tile without gaps or overlaps.
    assert queue.start_time == round((100.0 + OFFSET) * 1e9)
    assert queue.end_time == prefill.start_time
    assert prefill.end_time == decode.start_time
    assert decode.end_time == round((102.0 + OFFSET) * 1e9)
    timings = finished.timings
    for span, seconds in (
        (queue, timings.queue_seconds),
        (prefill, timings.prefill_seconds),
        (decode, timings.decode_seconds),
    ):
        assert seconds is not None
        assert ((span.end_time or 0) - (span.start_time or 0)) / 1e9 == pytest.approx(seconds, abs=1e-6)
    assert request.start_time == round((99.990 + OFFSET) * 1e9)
    assert [event.name for event in request.events] == ["first_token"]
    assert request.events[0].timestamp == prefill.end_time


def test_attributes_follow_gen_ai_conventions(traced: tuple[TracerProvider, InMemorySpanExporter]) -> None:
    provider, exporter = traced
    finish_under_server_span(provider, TracingObserver(provider), record())
    spans = by_name(exporter.get_finished_spans())
    attributes = dict(spans["chat tiny"].attributes or {})
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.request.model"] == "tiny"
    assert attributes["gen_ai.request.max_tokens"] == 6
    assert attributes["gen_ai.request.temperature"] == 0.5
    assert attributes["gen_ai.usage.input_tokens"] == 7
    assert attributes["gen_ai.usage.output_tokens"] == 6
    assert attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert attributes["phasescope.time_to_first_token_seconds"] == pytest.approx(0.76)
    decode = dict(spans["decode"].attributes or {})
    # (6 − 1) tokens over 1.25 s of decode.
    assert decode["phasescope.decode_tokens_per_second"] == pytest.approx(4.0)


def test_no_text_in_spans_by_default(traced: tuple[TracerProvider, InMemorySpanExporter]) -> None:
    provider, exporter = traced
    finish_under_server_span(provider, TracingObserver(provider), record())
    for span in exporter.get_finished_spans():
        assert MARKER not in repr(dict(span.attributes or {}))
        assert MARKER not in span.name


def test_text_only_when_turned_on(traced: tuple[TracerProvider, InMemorySpanExporter]) -> None:
    provider, exporter = traced
    finish_under_server_span(provider, TracingObserver(provider, include_text=True), record())
    attributes = dict(by_name(exporter.get_finished_spans())["chat tiny"].attributes or {})
    assert attributes["phasescope.output"] == f"output {MARKER}"


def test_cancelled_request_has_error_status_and_its_exception(
    traced: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exporter = traced
    cancelled = record(
        code="CANCELLED",
        finish_reason="abort",
        error=asyncio.CancelledError(),
        ended_wall_time=101.5 + OFFSET,
        stamps=EngineTimestamps(99.99 + OFFSET, 100.0, 100.25, 100.75, 101.25),
    )
    finish_under_server_span(provider, TracingObserver(provider), cancelled)
    request = by_name(exporter.get_finished_spans())["chat tiny"]
    assert request.status.status_code is StatusCode.ERROR
    assert request.status.description == "CANCELLED"
    assert [event.name for event in request.events] == ["first_token", "exception"]
    assert request.end_time == round((101.5 + OFFSET) * 1e9)


def test_request_cancelled_while_queued_has_only_a_queue_span(
    traced: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exporter = traced
    queued_only = record(
        code="CANCELLED",
        finish_reason="abort",
        completion_tokens=0,
        stamps=EngineTimestamps(99.99 + OFFSET, 100.0, 0.0, 0.0, 0.0),
        ended_wall_time=100.5 + OFFSET,
    )
    finish_under_server_span(provider, TracingObserver(provider), queued_only)
    names = sorted(span.name for span in exporter.get_finished_spans())
    assert names == ["chat tiny", "queue", "server"]
    queue = by_name(exporter.get_finished_spans())["queue"]
    assert queue.end_time == round((100.5 + OFFSET) * 1e9)


def test_trace_id_is_known_only_inside_a_sampled_span(traced: tuple[TracerProvider, InMemorySpanExporter]) -> None:
    provider, _ = traced
    assert current_trace_id() is None
    with provider.get_tracer("test").start_as_current_span("server") as span:
        assert current_trace_id() == format(span.get_span_context().trace_id, "032x")


def test_tracing_off_builds_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    from server.config import Settings
    from server.tracing_setup import build_tracing

    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    threads_before = threading.active_count()
    assert build_tracing(Settings()) is None
    assert threading.active_count() == threads_before
