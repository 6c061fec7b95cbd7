"""Traces over real OTLP: the caller's trace continues into the server, with phase spans at engine times."""

from __future__ import annotations

import pytest
from opentelemetry.proto.trace.v1 import trace_pb2

from phasescope.client.client import Client, build_request, new_traceparent
from support.otlp import OtlpReceiver
from support.servers import ServerProcess


def by_name(spans: list[trace_pb2.Span]) -> dict[str, trace_pb2.Span]:
    return {span.name: span for span in spans}


def seconds(span: trace_pb2.Span) -> float:
    return (span.end_time_unix_nano - span.start_time_unix_nano) / 1e9


def test_streamed_request_continues_the_callers_trace_with_its_stage_spans(
    client: Client, otlp_receiver: OtlpReceiver
) -> None:
    traceparent, trace_id = new_traceparent()
    caller_span_id = bytes.fromhex(traceparent.split("-")[2])
    chunks = list(
        client.generate_stream(
            build_request(prompt="Trace me:", max_tokens=8, ignore_eos=True), traceparent=traceparent
        )
    )
    timings = chunks[-1].timings
    # server span + request span + frontend, intake, queue, prefill, decode.
    spans = otlp_receiver.wait_for(trace_id, 5)
    server_span = next(span for span in spans if span.kind == trace_pb2.Span.SPAN_KIND_SERVER)
    assert server_span.name == "/phasescope.v1.Inference/GenerateStream"
    assert server_span.parent_span_id == caller_span_id
    request_span = by_name(spans)["text_completion SmolLM2-135M-Instruct"]
    assert request_span.parent_span_id == server_span.span_id
    children = sorted(
        (span for span in spans if span.parent_span_id == request_span.span_id), key=lambda s: s.start_time_unix_nano
    )
    assert [span.name for span in children] == ["frontend", "intake", "queue", "prefill", "decode"]
    frontend, intake, queue, prefill, decode = children
    assert seconds(frontend) == pytest.approx(timings.frontend_seconds, abs=1e-3)
    assert seconds(intake) == pytest.approx(timings.intake_seconds, abs=1e-3)
    assert seconds(queue) == pytest.approx(timings.queue_seconds, abs=1e-3)
    assert seconds(prefill) == pytest.approx(timings.prefill_seconds, abs=1e-3)
    assert seconds(decode) == pytest.approx(timings.decode_seconds, abs=1e-3)
    attributes = {attribute.key: attribute.value for attribute in request_span.attributes}
    assert attributes["gen_ai.usage.output_tokens"].int_value == 8
    assert attributes["gen_ai.request.model"].string_value == "SmolLM2-135M-Instruct"


def test_cancelled_request_span_has_an_error_status(client: Client, otlp_receiver: OtlpReceiver) -> None:
    traceparent, trace_id = new_traceparent()
    stream = client.generate_stream(
        build_request(prompt="Cancel me:", max_tokens=500, ignore_eos=True), traceparent=traceparent
    )
    for index, _ in enumerate(stream):
        if index == 2:
            stream.cancel()  # type: ignore[attr-defined]  # the call object is also a grpc.Future
            break
    spans = otlp_receiver.wait_for(trace_id, 5)
    request_span = by_name(spans)["text_completion SmolLM2-135M-Instruct"]
    assert request_span.status.code == trace_pb2.Status.STATUS_CODE_ERROR
    assert request_span.status.message == "CANCELLED"
    assert any(event.name == "exception" for event in request_span.events)


def test_phase_histograms_carry_the_trace_id_as_exemplar(server: ServerProcess, client: Client) -> None:
    traceparent, trace_id = new_traceparent()
    client.generate(build_request(prompt="Exemplar:", max_tokens=4, ignore_eos=True), traceparent=traceparent)
    openmetrics = server.metrics_text(openmetrics=True)
    assert f'trace_id="{trace_id}"' in openmetrics
    # The classic text format has no exemplars and stays as it was.
    assert "trace_id" not in server.metrics_text()
