"""Live roofline figures under concurrent load on the real engine, and their return to idle."""

from __future__ import annotations

import json
import threading
import time

import pytest

from phasescope.cli.main import main
from phasescope.client.client import build_request
from phasescope.telemetry.exposition import Samples, sum_samples
from support.servers import WINDOW_SECONDS, ServerProcess

STREAMS = 6


class Load:
    """Concurrent streams that decode together once each has its first token."""

    def __init__(self, server: ServerProcess, max_tokens: int) -> None:
        self.completion_tokens: list[int] = []
        self.errors: list[BaseException] = []
        self._lock = threading.Lock()
        self._started = threading.Barrier(STREAMS + 1)
        self._threads = [
            threading.Thread(target=self._stream, args=(server, index, max_tokens)) for index in range(STREAMS)
        ]
        for thread in self._threads:
            thread.start()
        self._started.wait(120)

    def _stream(self, server: ServerProcess, index: int, max_tokens: int) -> None:
        first = True
        try:
            with server.client() as client:
                request = build_request(prompt=f"Story number {index}:", max_tokens=max_tokens, ignore_eos=True)
                for chunk in client.generate_stream(request):
                    if first:
                        first = False
                        self._started.wait(120)
                    if chunk.HasField("usage"):
                        with self._lock:
                            self.completion_tokens.append(chunk.usage.completion_tokens)
        except BaseException as exc:
            self.errors.append(exc)
            if first:
                self._started.abort()

    def join(self) -> None:
        for thread in self._threads:
            thread.join(300)


def gauge(samples: Samples, name: str, phase: str = "decode") -> float:
    return sum_samples(samples, name, engine="0", phase=phase)


def device(samples: Samples, name: str) -> float:
    return sum_samples(samples, name, engine="0")


def present(samples: Samples, name: str, phase: str) -> bool:
    return any(
        series == name and dict(labels).get("phase") == phase and dict(labels).get("engine") == "0"
        for series, labels in samples
    )


def decode_burst(server: ServerProcess, max_tokens: int) -> tuple[Load, Samples, float]:
    """Concurrent streams run to completion, then one scrape; returns the load, the scrape and
    the seconds from the first request sent to the scrape's answer (an upper bound on how old
    the burst's first engine step was when the gauges were computed)."""
    sent = time.monotonic()
    load = Load(server, max_tokens=max_tokens)
    load.join()
    samples = server.samples()
    return load, samples, time.monotonic() - sent


def test_idle_window_reads_zero_then_a_decode_burst_agrees_with_counters_and_clients(server: ServerProcess) -> None:
    # A window with no traffic: the device reads utilisation 0 and idleness 1 (idle is not
    # saturation), and neither phase has an operating point ("no steps", not "100 % idle").
    time.sleep(WINDOW_SECONDS + 0.5)
    idle = server.samples()
    assert device(idle, "phasescope_device_memory_bandwidth_utilization_ratio") == 0
    assert device(idle, "phasescope_device_compute_utilization_ratio") == 0
    assert device(idle, "phasescope_device_compute_idle_ratio") == 1
    assert device(idle, "phasescope_engine_busy_ratio") == 0
    for phase in ("prefill", "decode"):
        assert not present(idle, "phasescope_memory_bandwidth_utilization_ratio", phase)
        assert not present(idle, "phasescope_arithmetic_intensity_flops_per_byte", phase)
        assert gauge(idle, "phasescope_tokens_per_second", phase) == 0
    # A burst that lies wholly inside the gauges' window, so the window holds exactly its steps
    # and the figures can be compared exactly, whatever the machine's speed. A slow machine
    # gets a shorter burst rather than a looser comparison.
    before = idle
    for max_tokens in (32, 16, 8):
        load, burst, seconds = decode_burst(server, max_tokens)
        assert not load.errors
        if seconds < WINDOW_SECONDS:
            break
        time.sleep(WINDOW_SECONDS + 0.5)  # let the overlong burst leave the window
        before = server.samples()
    else:
        pytest.fail(f"no burst of {STREAMS} streams finished inside the {WINDOW_SECONDS:g} s window")
    step_tokens = sum_samples(burst, "phasescope_engine_step_tokens_total", phase="decode") - sum_samples(
        before, "phasescope_engine_step_tokens_total", phase="decode"
    )
    # The same steps seen three ways: the gauge over the window, the counter, and the clients.
    assert gauge(burst, "phasescope_tokens_per_second") * WINDOW_SECONDS == pytest.approx(step_tokens)
    assert sum(load.completion_tokens) == STREAMS * max_tokens
    # Each stream's first token comes from its prefill step; every later one from a decode step.
    assert step_tokens == STREAMS * (max_tokens - 1)
    # Every token the clients got is counted once by us and once by vLLM.
    decode_delta = sum_samples(burst, "phasescope_tokens_total", phase="decode") - sum_samples(
        before, "phasescope_tokens_total", phase="decode"
    )
    generation_delta = sum_samples(burst, "vllm:generation_tokens_total") - sum_samples(
        before, "vllm:generation_tokens_total"
    )
    assert decode_delta == generation_delta == STREAMS * max_tokens
    # Decode reads memory and leaves compute mostly idle; the model cannot exceed the measured
    # bandwidth by much (caches can serve part of the weights on a CPU).
    assert 0 < gauge(burst, "phasescope_memory_bandwidth_utilization_ratio") <= 1.2
    assert 0 < device(burst, "phasescope_device_compute_idle_ratio") < 1
    # The device holds every phase: at least each phase's part.
    for phase in ("prefill", "decode"):
        assert device(burst, "phasescope_device_memory_bandwidth_utilization_ratio") >= gauge(
            burst, "phasescope_memory_bandwidth_utilization_ratio", phase
        )
    # The streams decoded together: steps carried more than one sequence on average.
    assert sum_samples(burst, "phasescope_decode_batch_size", engine="0") > 1


def test_peaks_are_exported_with_their_source(server: ServerProcess) -> None:
    samples = server.samples()
    sources = {dict(labels)["source"] for (name, labels) in samples if name == "phasescope_hardware_info"}
    # A CPU has no datasheet row: its peaks are measured by the probe.
    assert sources == {"measured"}
    assert server.sample_sum("phasescope_hardware_peak_memory_bandwidth_bytes_per_second") > 0
    assert server.sample_sum("phasescope_roofline_ridge_point_flops_per_byte") > 0
    with server.client() as client:
        info = client.model_info()
    assert info.peak_source == "measured"
    assert info.flops_per_token == pytest.approx(2 * info.parameter_count)
    assert info.ridge_point_flops_per_byte == pytest.approx(
        info.peak_flops / info.peak_memory_bandwidth_bytes_per_second
    )


def test_calculator_reads_live_operating_points(server: ServerProcess, capsys: pytest.CaptureFixture[str]) -> None:
    with server.client() as client:
        client.generate(build_request(prompt="Warm the window:", max_tokens=24, ignore_eos=True))
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    argv = ["roofline", "--params", "135e6", "--dtype", "fp32", "--hardware", "l4", "--json", "--metrics-url", url]
    assert main(argv) == 0
    live = json.loads(capsys.readouterr().out)["live"]
    decode = [point for point in live if point["phase"] == "decode"]
    assert decode
    assert decode[0]["arithmetic_intensity_flops_per_byte"] > 0
    assert decode[0]["achieved_flops_per_second"] > 0
