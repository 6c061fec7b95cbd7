"""Live roofline figures under concurrent load on the real engine, and their return to idle."""

from __future__ import annotations

import json
import threading
import time

import pytest

from server.cli import main
from server.client import build_request
from support.servers import WINDOW_SECONDS, ServerProcess

STREAMS = 6


class Load:
    """Concurrent streams that record when each token reached the client."""

    def __init__(self, server: ServerProcess, max_tokens: int) -> None:
        self.arrivals: list[tuple[float, int]] = []
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
                    with self._lock:
                        self.arrivals.append((time.monotonic(), len(chunk.token_ids)))
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

    def tokens_between(self, start: float, end: float) -> int:
        with self._lock:
            return sum(count for at, count in self.arrivals if start <= at < end)

    def join(self) -> None:
        for thread in self._threads:
            thread.join(300)


def gauge(server: ServerProcess, name: str, phase: str = "decode") -> float:
    return server.sample_sum(name, engine="0", phase=phase)


def test_decode_figures_agree_with_counters_and_clients_then_go_idle(server: ServerProcess) -> None:
    generation_before = server.sample_sum("vllm:generation_tokens_total")
    decode_before = server.sample_sum("phasescope_tokens_total", phase="decode")
    load = Load(server, max_tokens=240)
    try:
        # Let the window fill with steady decoding.
        time.sleep(WINDOW_SECONDS + 0.5)
        start = time.monotonic()
        counter_start = server.sample_sum("phasescope_engine_step_tokens_total", phase="decode")
        time.sleep(WINDOW_SECONDS)
        end = time.monotonic()
        counter_end = server.sample_sum("phasescope_engine_step_tokens_total", phase="decode")
        tokens_per_second = gauge(server, "phasescope_tokens_per_second")
        bandwidth = gauge(server, "phasescope_memory_bandwidth_utilization_ratio")
        idle = gauge(server, "phasescope_compute_idle_ratio")
        batch = server.sample_sum("phasescope_decode_batch_size", engine="0")
        clients_per_second = load.tokens_between(start, end) / (end - start)
    finally:
        load.join()
    assert not load.errors
    counter_rate = (counter_end - counter_start) / (end - start)
    assert tokens_per_second > 0
    # The same window seen three ways: the gauge, rate() of the counter, and the clients.
    assert tokens_per_second == pytest.approx(counter_rate, rel=0.10)
    assert tokens_per_second == pytest.approx(clients_per_second, rel=0.10)
    # Decode reads memory hard and leaves compute mostly idle; the model cannot exceed
    # the measured bandwidth by much (caches can serve part of the weights on a CPU).
    assert 0 < bandwidth <= 1.2
    assert 0 <= idle < 1
    assert batch > 1
    # Every token the clients got is counted once by us and once by vLLM.
    decode_delta = server.sample_sum("phasescope_tokens_total", phase="decode") - decode_before
    generation_delta = server.sample_sum("vllm:generation_tokens_total") - generation_before
    assert decode_delta == sum(load.completion_tokens) == STREAMS * 240
    assert generation_delta == decode_delta
    # A window after the traffic stopped, utilisation is 0 and idleness 1: idle is not saturation.
    time.sleep(WINDOW_SECONDS + 0.5)
    assert gauge(server, "phasescope_memory_bandwidth_utilization_ratio") == 0
    assert gauge(server, "phasescope_compute_utilization_ratio") == 0
    assert gauge(server, "phasescope_compute_idle_ratio") == 1
    assert gauge(server, "phasescope_tokens_per_second") == 0


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
