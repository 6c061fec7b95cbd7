"""A real OTLP/gRPC trace receiver for tests: opentelemetry-proto's TraceService on a free port."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self._spans: list[trace_pb2.Span] = []
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        # opentelemetry-proto's generated gRPC module carries no annotations.
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)  # type: ignore[no-untyped-call]
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    def Export(  # the OTLP service's method name
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        with self._lock:
            for resource_spans in request.resource_spans:
                for scope_spans in resource_spans.scope_spans:
                    self._spans.extend(scope_spans.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self, trace_id_hex: str) -> list[trace_pb2.Span]:
        wanted = bytes.fromhex(trace_id_hex)
        with self._lock:
            return [span for span in self._spans if span.trace_id == wanted]

    def wait_for(self, trace_id_hex: str, count: int, timeout: float = 20.0) -> list[trace_pb2.Span]:
        """The trace's spans once at least `count` have arrived."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            spans = self.spans(trace_id_hex)
            if len(spans) >= count:
                return spans
            time.sleep(0.05)
        raise TimeoutError(f"only {len(self.spans(trace_id_hex))} of {count} spans of trace {trace_id_hex} arrived")

    def stop(self) -> None:
        self._server.stop(grace=None)
