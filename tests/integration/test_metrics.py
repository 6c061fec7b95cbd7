"""/metrics holds exactly what the clients were served, and documents itself."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from phasescope.client.client import Client, build_request
from support.servers import ServerProcess

DOCS = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
PHASES = ("queue", "prefill", "decode")


def test_n_requests_land_in_the_phase_histograms_and_token_counters(server: ServerProcess, client: Client) -> None:
    def snapshot() -> dict[str, float]:
        values = {phase: server.sample_sum("phasescope_request_phase_seconds_count", phase=phase) for phase in PHASES}
        for phase in PHASES:
            # The same engine stamps as vLLM's own phase histograms: the sums agree too.
            values[f"{phase}_sum"] = server.sample_sum("phasescope_request_phase_seconds_sum", phase=phase)
            values[f"vllm_{phase}_sum"] = server.sample_sum(f"vllm:request_{phase}_time_seconds_sum")
            values[f"vllm_{phase}_count"] = server.sample_sum(f"vllm:request_{phase}_time_seconds_count")
        values["ttft"] = server.sample_sum("phasescope_time_to_first_token_seconds_count")
        values["e2e"] = server.sample_sum("phasescope_request_duration_seconds_count")
        values["decode_tokens"] = server.sample_sum("phasescope_tokens_total", phase="decode")
        values["ok"] = server.sample_sum("phasescope_requests_total", code="OK")
        values["itl"] = server.sample_sum("phasescope_inter_token_latency_seconds_count")
        return values

    before = snapshot()
    n = 5
    completion_tokens = 0
    for index in range(n):
        request = build_request(prompt=f"List {index + 2} colours:", max_tokens=6 + index, ignore_eos=True)
        if index % 2:
            completion_tokens += client.generate(request).usage.completion_tokens
        else:
            completion_tokens += list(client.generate_stream(request))[-1].usage.completion_tokens
    after = snapshot()
    for phase in PHASES:
        assert after[phase] - before[phase] == n, phase
        assert after[f"vllm_{phase}_count"] - before[f"vllm_{phase}_count"] == n, phase
        assert after[f"{phase}_sum"] - before[f"{phase}_sum"] == pytest.approx(
            after[f"vllm_{phase}_sum"] - before[f"vllm_{phase}_sum"], abs=1e-6
        ), phase
    assert after["ttft"] - before["ttft"] == n
    assert after["e2e"] - before["e2e"] == n
    assert after["ok"] - before["ok"] == n
    assert after["decode_tokens"] - before["decode_tokens"] == completion_tokens == sum(6 + i for i in range(n))
    # One gap per token after the first of each request.
    assert after["itl"] - before["itl"] == completion_tokens - n


def test_every_exported_series_is_documented(server: ServerProcess, client: Client) -> None:
    client.generate(build_request(prompt="hi", max_tokens=2))
    exported = set(re.findall(r"^# TYPE (phasescope_\w+) ", server.metrics_text(), flags=re.MULTILINE))
    assert exported
    documented = set(re.findall(r"`(phasescope_\w+)`", DOCS.read_text()))
    # Counters are exported as NAME with NAME_total samples; the docs name the samples.
    missing = {name for name in exported if name not in documented and f"{name}_total" not in documented}
    assert not missing, f"exported but not documented in docs/metrics.md: {sorted(missing)}"


def test_no_series_is_ours_and_named_vllm(server: ServerProcess) -> None:
    text = server.metrics_text()
    assert "vllm:num_requests_running" in text  # vLLM's reference series stay on
    assert not re.search(r"^phasescope_\w*vllm", text, flags=re.MULTILINE)
    assert 'model="SmolLM2-135M-Instruct"' in text
