import pytest
from prometheus_client import CollectorRegistry

from telemetry.hardware import HardwarePeaks
from telemetry.model_cost import model_cost_from_config
from telemetry.steps import RooflineTracker, StepForwarder, StepRecord, split_by_phase

# A toy device: 100 GB/s and 1 TFLOP/s, ridge point 10 FLOP/byte.
PEAKS = HardwarePeaks("toy", 100e9, {"fp32": 1e12}, "measured", "toy device")
CONFIG = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2}
COST = model_cost_from_config(CONFIG, parameter_count=1_000_000, dtype="float32")  # 4 MB of weights


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def tracker(clock: FakeClock, registry: CollectorRegistry, **kwargs: object) -> RooflineTracker:
    return RooflineTracker("m", COST, "float32", PEAKS, registry, window_seconds=10.0, clock=clock, **kwargs)  # type: ignore[arg-type]


def decode_step(batch: int, engine: int = 0, flops: float | None = None, read_bytes: float | None = None) -> StepRecord:
    return StepRecord(engine, 0, 0, batch, batch, 0.05, flops=flops, read_bytes=read_bytes)


def gauge(registry: CollectorRegistry, name: str, phase: str, engine: str = "0") -> float | None:
    return registry.get_sample_value(name, {"model": "m", "engine": engine, "phase": phase})


def test_mixed_step_is_split_by_token_counts() -> None:
    step = StepRecord(
        0, prefill_requests=1, prefill_tokens=300, decode_requests=100, decode_tokens=100, elapsed_seconds=0.4
    )
    shares = split_by_phase(step, flops=8e9, bytes_read=4e6)
    assert shares["prefill"].seconds == pytest.approx(0.3)
    assert shares["decode"].seconds == pytest.approx(0.1)
    assert shares["prefill"].flops == pytest.approx(6e9)
    assert shares["decode"].bytes_read == pytest.approx(1e6)
    assert shares["decode"].requests == 100


def test_window_gauges_report_decode_saturation_then_idle() -> None:
    clock, registry = FakeClock(), CollectorRegistry()
    roofline = tracker(clock, registry)
    clock.now += 10
    # 100 decode steps of batch 4 in 10 s, each read 5e8 bytes and did 4e8 FLOPs (the engine's estimate).
    for _ in range(100):
        roofline.record(decode_step(4, flops=4e8, read_bytes=5e8))
    assert gauge(registry, "phasescope_tokens_per_second", "decode") == pytest.approx(40.0)
    # 100 × 5e8 bytes / 10 s = 5e9 B/s of 100e9 B/s.
    assert gauge(registry, "phasescope_memory_bandwidth_utilization_ratio", "decode") == pytest.approx(0.05)
    # 100 × 4e8 FLOPs / 10 s = 4e9 FLOP/s of 1e12 FLOP/s.
    assert gauge(registry, "phasescope_compute_utilization_ratio", "decode") == pytest.approx(0.004)
    assert gauge(registry, "phasescope_compute_idle_ratio", "decode") == pytest.approx(0.996)
    assert gauge(registry, "phasescope_arithmetic_intensity_flops_per_byte", "decode") == pytest.approx(0.8)
    assert registry.get_sample_value("phasescope_decode_batch_size", {"model": "m", "engine": "0"}) == 4
    assert gauge(registry, "phasescope_model_bytes_read_total", "decode") == pytest.approx(5e10)
    assert gauge(registry, "phasescope_engine_busy_seconds_total", "decode") == pytest.approx(5.0)
    # No traffic for a whole window: idle must not look like saturation.
    clock.now += 11
    assert gauge(registry, "phasescope_memory_bandwidth_utilization_ratio", "decode") == 0
    assert gauge(registry, "phasescope_compute_utilization_ratio", "decode") == 0
    assert gauge(registry, "phasescope_compute_idle_ratio", "decode") == 1
    assert gauge(registry, "phasescope_tokens_per_second", "decode") == 0
    assert registry.get_sample_value("phasescope_decode_batch_size", {"model": "m", "engine": "0"}) == 0
    # Counters keep the history for PromQL windows.
    assert gauge(registry, "phasescope_model_bytes_read_total", "decode") == pytest.approx(5e10)


def test_cost_model_fills_in_without_engine_estimates_and_is_cross_checked() -> None:
    clock, registry = FakeClock(), CollectorRegistry()
    roofline = tracker(clock, registry)
    roofline.record(StepRecord(0, 0, 0, 2, 2, 0.01, kv_cache_tokens=100))
    # 2 tokens × 2 × 1e6 parameters; weights 4e6 bytes + 100 tokens × 2 × 2 × 2 × 16 × 4 bytes of KV.
    assert gauge(registry, "phasescope_model_flops_total", "decode") == pytest.approx(4e6)
    assert gauge(registry, "phasescope_model_bytes_read_total", "decode") == pytest.approx(4e6 + 100 * 512)
    assert (
        registry.get_sample_value("phasescope_cost_model_agreement_ratio", {"model": "m", "quantity": "flops"}) is None
    )
    roofline.record(decode_step(2, flops=2e6, read_bytes=4.0512e6))
    assert registry.get_sample_value(
        "phasescope_cost_model_agreement_ratio", {"model": "m", "quantity": "flops"}
    ) == pytest.approx(2.0)


def test_engines_on_one_cpu_share_its_peaks() -> None:
    clock, registry = FakeClock(), CollectorRegistry()
    roofline = tracker(clock, registry, engines=2, shared_device=True)
    clock.now += 10
    for engine in (0, 1):
        roofline.record(decode_step(1, engine=engine, flops=1e9, read_bytes=1e10))
    # Each engine: 1e10 bytes / 10 s against half of 100 GB/s.
    assert gauge(registry, "phasescope_memory_bandwidth_utilization_ratio", "decode", "0") == pytest.approx(0.02)
    assert gauge(registry, "phasescope_memory_bandwidth_utilization_ratio", "decode", "1") == pytest.approx(0.02)
    assert registry.get_sample_value(
        "phasescope_hardware_peak_memory_bandwidth_bytes_per_second", {"model": "m", "source": "measured"}
    ) == pytest.approx(50e9)


def test_peaks_and_their_source_are_exported() -> None:
    registry = CollectorRegistry()
    tracker(FakeClock(), registry)
    assert registry.get_sample_value("phasescope_roofline_ridge_point_flops_per_byte", {"model": "m"}) == pytest.approx(
        10
    )
    labels = {"model": "m", "source": "measured", "dtype": "float32"}
    assert registry.get_sample_value("phasescope_hardware_peak_flops", labels) == 1e12
    info = {"model": "m", "device": "toy device", "source": "measured", "engines": "1"}
    assert registry.get_sample_value("phasescope_hardware_info", info) == 1


def test_forwarder_drops_steps_until_a_sink_is_attached() -> None:
    seen: list[StepRecord] = []
    forward = StepForwarder()
    forward(decode_step(1))
    forward.sink = seen.append
    forward(decode_step(2))
    assert [step.decode_requests for step in seen] == [2]


def test_queue_depth_is_exported_per_engine() -> None:
    registry = CollectorRegistry()
    roofline = tracker(FakeClock(), registry, engines=2)
    waiting = {"model": "m", "engine": "1", "state": "waiting"}
    assert registry.get_sample_value("phasescope_engine_requests", waiting) == 0
    roofline.record_queue(1, running=3, waiting=7, kv_cache_usage=0.25)
    assert registry.get_sample_value("phasescope_engine_requests", waiting) == 7
    assert registry.get_sample_value("phasescope_engine_requests", {**waiting, "state": "running"}) == 3
    assert registry.get_sample_value("phasescope_kv_cache_usage_ratio", {"model": "m", "engine": "1"}) == 0.25
