"""Prompts and outputs never reach logs, metrics or spans by default."""

from __future__ import annotations

import grpc
import pytest

from phasescope.client.client import Client, build_request, new_traceparent
from support.otlp import OtlpReceiver
from support.servers import ServerProcess

MARKER = "quokka-marker-5521"


def test_marker_text_appears_nowhere(server: ServerProcess, client: Client, otlp_receiver: OtlpReceiver) -> None:
    traceparent, trace_id = new_traceparent()
    chat = [("user", f"Repeat exactly: {MARKER} {MARKER}")]
    response = client.generate(build_request(chat=chat, max_tokens=24, temperature=0.0), traceparent=traceparent)
    with pytest.raises(grpc.RpcError):
        client.generate(build_request(prompt=f"{MARKER} bad", top_p=9.0))
    spans = otlp_receiver.wait_for(trace_id, 5)
    assert MARKER not in server.metrics_text()
    assert MARKER not in server.metrics_text(openmetrics=True)
    assert all(MARKER not in str(span) for span in spans)
    assert MARKER not in server.log_tail(lines=100_000)
    # The marker really went through the model (so its absence above means something).
    assert response.usage.prompt_tokens > 10
