import asyncio
import dataclasses
import threading

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from phasescope.telemetry.request.phases import (
    EngineTimestamps,
    FrontendTimestamps,
    KvTransferFigures,
    PhaseRecord,
    RequestParameters,
    RequestText,
    derive_phase_timings,
)
from phasescope.telemetry.request.tracing import TracingObserver, current_trace_id

OFFSET = 1_700_000_000.0  # wall = monotonic + OFFSET, read at the request's entry
FRONT = FrontendTimestamps(entry=99.990, wall_at_entry=99.990 + OFFSET, handed_to_engine=99.995, ended=102.001)
STAMPS = EngineTimestamps(queued_ts=100.0, scheduled_ts=100.25, first_token_ts=100.75, last_token_ts=102.0)
MARKER = "zebra-marker-4711"


def record(**overrides: object) -> PhaseRecord:
    values: dict[str, object] = {
        "model": "tiny",
        "code": "OK",
        "finish_reason": "length",
        "prompt_tokens": 7,
        "cached_prompt_tokens": 0,
        "completion_tokens": 6,
        "timings": derive_phase_timings(FRONT, STAMPS, 6),
        "stamps": STAMPS,
        "front": FRONT,
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


def test_request_span_has_stage_children_tiling_it(traced: tuple[TracerProvider, InMemorySpanExporter]) -> None:
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
    assert [c.name for c in children] == ["frontend", "intake", "queue", "prefill", "decode"]
    frontend, intake, queue, prefill, decode = children
    # One clock per request, placed on the wall clock by its own offset: the stages tile
    # the request from handler entry to last token without gaps or overlaps.
    assert frontend.start_time == request.start_time
    assert frontend.end_time == intake.start_time
    assert intake.end_time == queue.start_time == round((100.0 + OFFSET) * 1e9)
    assert queue.end_time == prefill.start_time
    assert prefill.end_time == decode.start_time
    assert decode.end_time == round((102.0 + OFFSET) * 1e9)
    timings = finished.timings
    for span, seconds in (
        (frontend, timings.frontend_seconds),
        (intake, timings.intake_seconds),
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
    assert "phasescope.lora_adapter" not in attributes  # the base model
    assert attributes["phasescope.time_to_first_token_seconds"] == pytest.approx(0.76)
    decode = dict(spans["decode"].attributes or {})
    # (6 − 1) tokens over 1.25 s of decode.
    assert decode["phasescope.decode_tokens_per_second"] == pytest.approx(4.0)


def test_a_request_with_an_adapter_names_it(traced: tuple[TracerProvider, InMemorySpanExporter]) -> None:
    provider, exporter = traced
    with_adapter = dataclasses.replace(record(), parameters=RequestParameters(operation="chat", adapter="sql"))
    finish_under_server_span(provider, TracingObserver(provider), with_adapter)
    attributes = dict(by_name(exporter.get_finished_spans())["chat tiny"].attributes or {})
    assert attributes["phasescope.lora_adapter"] == "sql"


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
        front=FrontendTimestamps(99.990, 99.990 + OFFSET, handed_to_engine=99.995, ended=101.5),
        stamps=EngineTimestamps(100.0, 100.25, 100.75, 101.25),
    )
    finish_under_server_span(provider, TracingObserver(provider), cancelled)
    request = by_name(exporter.get_finished_spans())["chat tiny"]
    assert request.status.status_code is StatusCode.ERROR
    assert request.status.description == "CANCELLED"
    assert [event.name for event in request.events] == ["first_token", "exception"]
    assert request.end_time == round((101.5 + OFFSET) * 1e9)


def test_request_ended_before_its_first_token_has_frontend_and_abandoned_spans(
    traced: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    # vLLM sends no stamps before a request's first token: queue and prefill cannot be told apart.
    provider, exporter = traced
    front = FrontendTimestamps(99.990, 99.990 + OFFSET, handed_to_engine=99.995, ended=100.5)
    unanswered = record(
        code="DEADLINE_EXCEEDED",
        finish_reason="error",
        completion_tokens=0,
        stamps=None,
        front=front,
        timings=derive_phase_timings(front, None, 0),
    )
    finish_under_server_span(provider, TracingObserver(provider), unanswered)
    spans = by_name(exporter.get_finished_spans())
    assert sorted(spans) == ["abandoned", "chat tiny", "frontend", "server"]
    assert spans["frontend"].end_time == spans["abandoned"].start_time
    assert spans["abandoned"].start_time == pytest.approx((99.995 + OFFSET) * 1e9, abs=1e3)
    assert spans["abandoned"].end_time == spans["chat tiny"].end_time
    assert spans["chat tiny"].end_time == pytest.approx((100.5 + OFFSET) * 1e9, abs=1e3)
    assert dict(spans["abandoned"].attributes or {})["phasescope.abandoned_seconds"] == pytest.approx(0.505)


def test_trace_id_is_known_only_inside_a_sampled_span(traced: tuple[TracerProvider, InMemorySpanExporter]) -> None:
    provider, _ = traced
    assert current_trace_id() is None
    with provider.get_tracer("test").start_as_current_span("server") as span:
        assert current_trace_id() == format(span.get_span_context().trace_id, "032x")


def test_tracing_off_builds_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    from phasescope.serve.config import Settings
    from phasescope.serve.tracing_setup import build_tracing

    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    threads_before = threading.active_count()
    assert build_tracing(Settings()) is None
    assert threading.active_count() == threads_before


def test_a_kv_transfer_is_a_span_inside_the_request_with_what_it_moved(
    traced: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exporter = traced
    transfer = KvTransferFigures(start=100.3, seconds=0.125, loaded_tokens=768, saved_tokens=0, bytes=7077888.0)
    engine = dataclasses.replace(STAMPS, transfer=transfer)
    finish_under_server_span(
        provider, TracingObserver(provider), record(stamps=engine, timings=derive_phase_timings(FRONT, engine, 6))
    )
    spans = by_name(exporter.get_finished_spans())
    request, prefill, kv = spans["chat tiny"], spans["prefill"], spans["kv_transfer"]
    assert kv.parent is not None
    assert kv.parent.span_id == request.context.span_id
    assert kv.start_time == round((100.3 + OFFSET) * 1e9)
    assert ((kv.end_time or 0) - (kv.start_time or 0)) / 1e9 == pytest.approx(0.125, abs=1e-6)
    # Inside prefill, which still ends at the first token.
    assert (prefill.start_time or 0) <= (kv.start_time or 0) < (kv.end_time or 0) <= (prefill.end_time or 0)
    assert kv.attributes is not None
    assert (kv.attributes["phasescope.kv_loaded_tokens"], kv.attributes["phasescope.kv_transfer_bytes"]) == (
        768,
        7077888.0,
    )
    # The stages that tile the request are all there.
    assert {"frontend", "intake", "queue", "prefill", "decode"} <= set(spans)
