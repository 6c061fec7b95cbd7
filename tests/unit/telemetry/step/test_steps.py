from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from phasescope.telemetry.errors import TelemetryErrors
from phasescope.telemetry.hardware.peaks import HardwarePeaks
from phasescope.telemetry.model.cost import model_cost_from_config
from phasescope.telemetry.step.aggregator import StepAggregator, StepSink
from phasescope.telemetry.step.attribution import StepCost, attribute_step
from phasescope.telemetry.step.prometheus import StepMetrics
from phasescope.telemetry.step.records import (
    EngineIteration,
    SchedulerState,
    SpeculativeStep,
    StepForwarder,
    StepRecord,
    StepReport,
)
from phasescope.telemetry.step.window import overlap_fraction, wait_reason

# A toy device: 100 GB/s and 1 TFLOP/s, ridge point 10 FLOP/byte.
PEAKS = HardwarePeaks("toy", 100e9, {"fp32": 1e12}, "measured", "toy device")
CONFIG = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2}
# 4 MB of weights; KV bytes per token = 2 × 2 layers × 2 KV heads × 16 head dim × 4 bytes = 512.
COST = model_cost_from_config(CONFIG, parameter_count=1_000_000, dtype="float32")
KV = 512


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def metrics(
    clock: FakeClock, registry: CollectorRegistry, engines: int = 1, shared: bool = False, **options: Any
) -> StepAggregator:
    """The steps' aggregator with its Prometheus export in `registry`."""
    peaks = PEAKS.shared_by(engines) if shared else PEAKS
    aggregator = StepAggregator(COST, "float32", peaks, engines=engines, window_seconds=10.0, clock=clock, **options)
    step_metrics = StepMetrics("m", aggregator)
    aggregator.add_sink(step_metrics)
    registry.register(step_metrics)
    return aggregator


def decode_step(
    batch: int,
    engine: int = 0,
    flops: float | None = None,
    read_bytes: float | None = None,
    elapsed: float = 0.05,
    kv_tokens: int = 0,
) -> StepRecord:
    return StepRecord(
        engine,
        0,
        0,
        batch,
        batch,
        elapsed,
        flops=flops,
        read_bytes=read_bytes,
        written_bytes=0.0,
        kv_cache_tokens=kv_tokens,
    )


def gauge(registry: CollectorRegistry, name: str, phase: str, engine: str = "0") -> float | None:
    return registry.get_sample_value(name, {"model": "m", "engine": engine, "phase": phase})


def device(registry: CollectorRegistry, name: str, engine: str = "0") -> float | None:
    return registry.get_sample_value(name, {"model": "m", "engine": engine})


def test_steps_are_classified_by_what_they_carried() -> None:
    assert StepRecord(0, 1, 300, 0, 0, 0.1).kind == "prefill"
    assert StepRecord(0, 0, 0, 4, 4, 0.1).kind == "decode"
    assert StepRecord(0, 1, 300, 4, 4, 0.1).kind == "mixed"


def test_in_a_mixed_step_decode_pays_the_weights_and_its_kv_and_the_chunk_its_margin() -> None:
    # 64 decoders holding 6,400 tokens of KV beside a 512-token chunk (the cache now holds both).
    step = StepRecord(0, 1, 512, 64, 64, 0.4, kv_cache_tokens=6_400 + 512)
    cost = attribute_step(step, COST, PEAKS.memory_bandwidth_bytes_per_second, 1e12)
    decode, prefill = cost.shares["decode"], cost.shares["prefill"]
    # FLOPs by the cost model: 2 × parameters per token, plus attention = 4 × 2 layers × 64 width ×
    # (query, context) pairs — for decode its 6,400 context tokens, for the chunk 512²/2 pairs.
    decode_flops = 64 * 2e6 + 4 * 2 * 64 * 6_400
    chunk_flops = 512 * 2e6 + 4 * 2 * 64 * 512**2 / 2
    assert decode.flops == pytest.approx(decode_flops)
    assert prefill.flops == pytest.approx(chunk_flops)
    # Decode reads what a decode-only step of its batch would: weights + its 6,400 tokens of KV.
    assert decode.read_bytes == pytest.approx(4e6 + 6_400 * KV)
    assert prefill.read_bytes == pytest.approx(512 * KV)
    assert decode.read_bytes + prefill.read_bytes == pytest.approx(cost.read_bytes)
    # Time by each phase's roofline time, max(bytes ÷ 100 GB/s, FLOPs ÷ 1 TFLOP/s): decode
    # max(7.3e6 B → 73 µs, 1.31e8 FLOP → 131 µs); the chunk max(0.5 MB → 5 µs, 1.09e9 FLOP → 1,091 µs).
    assert decode.seconds + prefill.seconds == pytest.approx(0.4)
    assert decode.seconds == pytest.approx(0.4 * decode_flops / (decode_flops + chunk_flops))


def test_decode_operating_point_is_the_same_with_or_without_a_chunk_beside_it() -> None:
    # The defect this guards: token-share splitting gave decode the whole step's intensity, so
    # decode plotted as compute-bound whenever prompts kept arriving. The engine's estimates
    # here include what a chunk adds besides its KV (activations: 20 kB per token each way).
    bandwidth = PEAKS.memory_bandwidth_bytes_per_second
    decode_only = StepRecord(
        0, 0, 0, 64, 64, 0.05, flops=64 * 2e6, read_bytes=4e6 + 6_400 * KV, written_bytes=64 * KV, kv_cache_tokens=6_400
    )
    with_chunk = StepRecord(
        0,
        1,
        512,
        64,
        64,
        0.4,
        flops=576 * 2e6,
        read_bytes=4e6 + 6_912 * KV + 512 * 20_000,
        written_bytes=576 * KV + 512 * 20_000,
        kv_cache_tokens=6_912,
    )
    alone = attribute_step(decode_only, COST, bandwidth, 1e12).shares["decode"]
    beside = attribute_step(with_chunk, COST, bandwidth, 1e12).shares["decode"]
    assert beside.flops / beside.moved_bytes == pytest.approx(alone.flops / alone.moved_bytes, rel=0.15)
    # The chunk carries everything it added.
    chunk = attribute_step(with_chunk, COST, bandwidth, 1e12).shares["prefill"]
    assert chunk.read_bytes == pytest.approx(512 * KV + 512 * 20_000)


def test_window_reports_decode_saturation_then_idle_without_phantom_phases() -> None:
    clock, registry = FakeClock(), CollectorRegistry()
    roofline = metrics(clock, registry)
    clock.now += 10
    # 100 decode steps of batch 4 in 10 s, each read 5e8 bytes and did 4e8 FLOPs (the engine's estimate).
    for _ in range(100):
        roofline.record(StepReport(step=decode_step(4, flops=4e8, read_bytes=5e8)))
    assert gauge(registry, "phasescope_tokens_per_second", "decode") == pytest.approx(40.0)
    # 100 × 5e8 bytes / 10 s = 5e9 B/s of 100e9 B/s.
    assert gauge(registry, "phasescope_memory_bandwidth_utilization_ratio", "decode") == pytest.approx(0.05)
    # 100 × 4e8 FLOPs / 10 s = 4e9 FLOP/s of 1e12 FLOP/s.
    assert gauge(registry, "phasescope_compute_utilization_ratio", "decode") == pytest.approx(0.004)
    assert gauge(registry, "phasescope_arithmetic_intensity_flops_per_byte", "decode") == pytest.approx(0.8)
    assert registry.get_sample_value("phasescope_decode_batch_size", {"model": "m", "engine": "0"}) == 4
    # Decode only: prefill ran no step, so it has no operating point (not "100 % idle").
    assert gauge(registry, "phasescope_memory_bandwidth_utilization_ratio", "prefill") is None
    assert gauge(registry, "phasescope_compute_utilization_ratio", "prefill") is None
    assert gauge(registry, "phasescope_tokens_per_second", "prefill") == 0
    # The device: the same figures, with idleness = 1 − MFU of all steps, and 5 s busy of 10.
    assert device(registry, "phasescope_device_memory_bandwidth_utilization_ratio") == pytest.approx(0.05)
    assert device(registry, "phasescope_device_compute_idle_ratio") == pytest.approx(0.996)
    assert device(registry, "phasescope_engine_busy_ratio") == pytest.approx(0.5)
    assert gauge(registry, "phasescope_model_read_bytes_total", "decode") == pytest.approx(5e10)
    assert gauge(registry, "phasescope_engine_busy_seconds_total", "decode") == pytest.approx(5.0)
    assert (
        registry.get_sample_value("phasescope_engine_steps_total", {"model": "m", "engine": "0", "kind": "decode"})
        == 100
    )
    # No traffic for a whole window: idle must not look like saturation.
    clock.now += 11
    assert gauge(registry, "phasescope_memory_bandwidth_utilization_ratio", "decode") is None
    assert gauge(registry, "phasescope_tokens_per_second", "decode") == 0
    assert device(registry, "phasescope_device_memory_bandwidth_utilization_ratio") == 0
    assert device(registry, "phasescope_device_compute_utilization_ratio") == 0
    assert device(registry, "phasescope_device_compute_idle_ratio") == 1
    assert device(registry, "phasescope_engine_busy_ratio") == 0
    assert registry.get_sample_value("phasescope_decode_batch_size", {"model": "m", "engine": "0"}) == 0
    # Counters keep the history for PromQL windows.
    assert gauge(registry, "phasescope_model_read_bytes_total", "decode") == pytest.approx(5e10)


def test_device_figures_hold_every_phase_and_each_phase_its_part() -> None:
    clock, registry = FakeClock(), CollectorRegistry()
    roofline = metrics(clock, registry)
    clock.now += 10
    roofline.record(StepReport(step=StepRecord(0, 1, 512, 64, 64, 0.4, kv_cache_tokens=6_912)))
    roofline.record(StepReport(step=decode_step(64, kv_tokens=6_464)))
    total = device(registry, "phasescope_device_memory_bandwidth_utilization_ratio") or 0.0
    parts = [
        gauge(registry, "phasescope_memory_bandwidth_utilization_ratio", phase) or 0.0
        for phase in ("prefill", "decode")
    ]
    assert total == pytest.approx(sum(parts))
    assert all(0 < part < total for part in parts)
    assert (
        registry.get_sample_value("phasescope_engine_steps_total", {"model": "m", "engine": "0", "kind": "mixed"}) == 1
    )


def test_a_step_longer_than_the_window_counts_only_its_part_inside() -> None:
    # The defect this guards: a 20 s CPU prefill stamped at its end put all its work in a 10 s window (utilisation 2).
    assert overlap_fraction(end=100.0, duration=20.0, window_start=90.0, window_end=100.0) == pytest.approx(0.5)
    assert overlap_fraction(end=85.0, duration=1.0, window_start=90.0, window_end=100.0) == 0.0
    clock, registry = FakeClock(), CollectorRegistry()
    roofline = metrics(clock, registry)
    clock.now += 30
    roofline.record(StepReport(step=StepRecord(0, 1, 4000, 0, 0, 20.0, flops=2e13, read_bytes=1e9, written_bytes=0.0)))
    # Half the step's FLOPs in the window: 1e13 / 10 s of 1e12 FLOP/s.
    assert device(registry, "phasescope_device_compute_utilization_ratio") == pytest.approx(1.0)
    assert device(registry, "phasescope_engine_busy_ratio") == pytest.approx(1.0)
    assert gauge(registry, "phasescope_tokens_per_second", "prefill") == pytest.approx(200.0)


def test_cost_model_fills_in_without_engine_estimates_and_is_cross_checked() -> None:
    clock, registry = FakeClock(), CollectorRegistry()
    roofline = metrics(clock, registry)
    roofline.record(StepReport(step=StepRecord(0, 0, 0, 2, 2, 0.01, kv_cache_tokens=100)))
    # 2 tokens × 2 × 1e6 parameters + attention over their 100 context tokens (4 × 2 layers × 64 width × 100);
    # weights 4e6 bytes + 100 tokens × 512 bytes of KV; 2 new KV entries written.
    assert gauge(registry, "phasescope_model_flops_total", "decode") == pytest.approx(4e6 + 4 * 2 * 64 * 100)
    assert gauge(registry, "phasescope_model_read_bytes_total", "decode") == pytest.approx(4e6 + 100 * KV)
    assert gauge(registry, "phasescope_model_written_bytes_total", "decode") == pytest.approx(2 * KV)
    assert (
        registry.get_sample_value("phasescope_cost_model_agreement_ratio", {"model": "m", "quantity": "flops"}) is None
    )
    roofline.record(StepReport(step=decode_step(2, flops=2e6, read_bytes=4.0512e6)))
    assert registry.get_sample_value(
        "phasescope_cost_model_agreement_ratio", {"model": "m", "quantity": "flops"}
    ) == pytest.approx(2.0)


def test_engines_on_one_cpu_share_its_peaks() -> None:
    clock, registry = FakeClock(), CollectorRegistry()
    roofline = metrics(clock, registry, engines=2, shared=True)
    clock.now += 10
    for engine in (0, 1):
        roofline.record(StepReport(step=decode_step(1, engine=engine, flops=1e9, read_bytes=1e10)))
    # Each engine: 1e10 bytes / 10 s against half of 100 GB/s.
    assert gauge(registry, "phasescope_memory_bandwidth_utilization_ratio", "decode", "0") == pytest.approx(0.02)
    assert gauge(registry, "phasescope_memory_bandwidth_utilization_ratio", "decode", "1") == pytest.approx(0.02)
    assert device(registry, "phasescope_device_memory_bandwidth_utilization_ratio", "1") == pytest.approx(0.02)
    assert registry.get_sample_value(
        "phasescope_hardware_peak_memory_bandwidth_bytes_per_second", {"model": "m", "source": "measured"}
    ) == pytest.approx(50e9)


def test_peaks_and_their_source_are_exported() -> None:
    registry = CollectorRegistry()
    metrics(FakeClock(), registry)
    assert registry.get_sample_value("phasescope_roofline_ridge_point_flops_per_byte", {"model": "m"}) == pytest.approx(
        10
    )
    labels = {"model": "m", "source": "measured", "dtype": "float32"}
    assert registry.get_sample_value("phasescope_hardware_peak_flops_per_second", labels) == 1e12
    info = {"model": "m", "device": "toy device", "source": "measured", "engines": "1"}
    assert registry.get_sample_value("phasescope_hardware_info", info) == 1


def test_engine_inter_token_latencies_and_preemptions_are_recorded() -> None:
    registry = CollectorRegistry()
    roofline = metrics(FakeClock(), registry)
    roofline.record(StepReport(iteration=EngineIteration(0, (0.0004, 0.0006, 0.5), preemptions=2)))
    itl = {"model": "m"}
    assert registry.get_sample_value("phasescope_inter_token_latency_seconds_count", itl) == 3
    # Sub-millisecond gaps land in their own buckets (a small model's decode on a GPU).
    assert registry.get_sample_value("phasescope_inter_token_latency_seconds_bucket", {**itl, "le": "0.0005"}) == 1
    assert registry.get_sample_value("phasescope_preemptions_total", {"model": "m", "engine": "0"}) == 2


def test_forwarder_drops_reports_until_a_sink_is_attached() -> None:
    seen: list[StepReport] = []
    forward = StepForwarder()
    forward.report(StepReport(step=decode_step(1)))
    forward.sink = seen.append
    forward.report(StepReport(step=decode_step(2)))
    assert [report.step.decode_requests for report in seen if report.step is not None] == [2]


def test_a_failing_sink_is_contained_and_counted() -> None:
    registry = CollectorRegistry()
    errors = TelemetryErrors("m")
    registry.register(errors)
    forward = StepForwarder(on_error=errors)

    def broken(report: StepReport) -> None:
        raise ZeroDivisionError("broken sink")

    forward.sink = broken
    forward.report(StepReport(step=decode_step(1)))
    forward.report(StepReport(scheduler=SchedulerState(0, 1, 0, 0.1)))
    assert registry.get_sample_value("phasescope_telemetry_errors_total", {"model": "m", "component": "step"}) == 2


def test_queue_depth_is_exported_per_engine() -> None:
    registry = CollectorRegistry()
    roofline = metrics(FakeClock(), registry, engines=2)
    waiting = {"model": "m", "engine": "1", "state": "waiting"}
    assert registry.get_sample_value("phasescope_engine_requests", waiting) == 0
    roofline.record(StepReport(scheduler=SchedulerState(1, running=3, waiting=7, kv_cache_usage=0.25, deferred=2)))
    assert registry.get_sample_value("phasescope_engine_requests", waiting) == 7
    assert registry.get_sample_value("phasescope_engine_requests", {**waiting, "state": "running"}) == 3
    # Held back until their grammar is compiled: apart from those waiting for a slot.
    assert registry.get_sample_value("phasescope_engine_requests", {**waiting, "state": "deferred"}) == 2
    assert registry.get_sample_value("phasescope_kv_cache_usage_ratio", {"model": "m", "engine": "1"}) == 0.25


def verdicts(registry: CollectorRegistry, phase: str, engine: str = "0") -> dict[str, float | None]:
    from phasescope.telemetry.step.verdict import VERDICTS

    return {
        name: registry.get_sample_value(
            "phasescope_bound", {"model": "m", "engine": engine, "phase": phase, "verdict": name}
        )
        for name in VERDICTS
    }


def test_decode_at_half_its_roof_reads_host_bound_and_near_it_memory_bound() -> None:
    clock, registry = FakeClock(), CollectorRegistry()
    roofline = metrics(clock, registry)
    clock.now += 10
    # 50 ms steps that read 2.6 GB at 100 GB/s (26 ms at the roof): 52 % of the roof reached.
    for _ in range(20):
        roofline.record(StepReport(step=decode_step(1, flops=2e6, read_bytes=2.6e9, elapsed=0.05)))
    assert gauge(registry, "phasescope_host_overhead_ratio", "decode") == pytest.approx(0.48)
    assert verdicts(registry, "decode") == {
        "memory": 0,
        "compute": 0,
        "host": 1,
        "queue": 0,
        "idle": 0,
        "capacity": 0,
        "adapters": 0,
    }
    # No step carried prefill: idle, and no overhead figure for it.
    assert verdicts(registry, "prefill")["idle"] == 1
    assert gauge(registry, "phasescope_host_overhead_ratio", "prefill") is None
    # Steps that read 4.5 GB in the same 50 ms run at 90 % of the roof: memory-bound.
    clock.now += 20
    for _ in range(20):
        roofline.record(StepReport(step=decode_step(1, flops=2e6, read_bytes=4.5e9, elapsed=0.05)))
    assert verdicts(registry, "decode")["memory"] == 1
    assert gauge(registry, "phasescope_host_overhead_ratio", "decode") == pytest.approx(0.1)


def test_requests_waiting_for_a_slot_make_prefill_queue_bound_and_use_up_headroom() -> None:
    clock, registry = FakeClock(), CollectorRegistry()
    roofline = metrics(clock, registry)
    # One running, three waiting, for two seconds: 75 % of request time queued.
    for _ in range(3):
        roofline.record(StepReport(scheduler=SchedulerState(0, running=1, waiting=3, kv_cache_usage=0.2)))
        clock.now += 1
    assert device(registry, "phasescope_queue_wait_ratio") == pytest.approx(0.75)
    assert verdicts(registry, "prefill")["queue"] == 1
    labels = {"model": "m", "engine": "0", "limit": "queue"}
    assert registry.get_sample_value("phasescope_headroom_ratio", labels) == 0.0


def reason_share(registry: CollectorRegistry, reason: str) -> float | None:
    labels = {"model": "m", "engine": "0", "reason": reason}
    return registry.get_sample_value("phasescope_queue_wait_by_reason_ratio", labels)


def test_requests_waiting_for_kv_blocks_with_slots_free_read_capacity_bound_not_queue_bound() -> None:
    clock, registry = FakeClock(), CollectorRegistry()
    roofline = metrics(clock, registry, kv_cache_capacity_tokens=4096)
    # Two running of eight slots, three waiting for blocks, the cache 96 % full, for two seconds: 60 % of
    # request time waiting for blocks, not for a slot.
    for _ in range(3):
        roofline.record(
            StepReport(scheduler=SchedulerState(0, running=2, waiting=3, kv_cache_usage=0.96, reason="kv_cache"))
        )
        clock.now += 1
    assert reason_share(registry, "kv_cache") == pytest.approx(0.6)
    assert reason_share(registry, "slot") == 0.0
    assert verdicts(registry, "prefill")["capacity"] == 1
    assert verdicts(registry, "decode")["capacity"] == 1
    waiting = {"model": "m", "engine": "0", "reason": "kv_cache"}
    assert registry.get_sample_value("phasescope_engine_waiting_requests", waiting) == 3
    assert registry.get_sample_value("phasescope_engine_waiting_requests", {**waiting, "reason": "slot"}) == 0
    # 0.96 × 4,096 = 3,932 tokens in use by two sequences all window: 48 % of the cache each, so it holds
    # 2 ÷ 0.96 = 2.08 of them at the window's mean context.
    assert device(registry, "phasescope_kv_cache_capacity_tokens") == 4096
    assert device(registry, "phasescope_kv_cache_tokens") == 3932
    assert device(registry, "phasescope_kv_cache_sequences_fit") == pytest.approx(2 / 0.96)
    # Once nothing runs, the window still remembers what the sequences used.
    roofline.record(StepReport(scheduler=SchedulerState(0, running=0, waiting=0, kv_cache_usage=0.0)))
    assert device(registry, "phasescope_kv_cache_sequences_fit") == pytest.approx(2 / 0.96)


def test_requests_waiting_for_an_adapter_slot_are_counted_apart_and_read_adapters_bound() -> None:
    clock, registry = FakeClock(), CollectorRegistry()
    roofline = metrics(clock, registry, kv_cache_capacity_tokens=4096)
    # Two running (one adapter each, --max-loras 2), four waiting: three for a third adapter, one for blocks.
    for _ in range(3):
        state = SchedulerState(0, running=2, waiting=4, kv_cache_usage=0.5, reason="kv_cache", waiting_for_adapters=3)
        roofline.record(StepReport(scheduler=state))
        clock.now += 1
    assert reason_share(registry, "adapters") == pytest.approx(3 / 6)
    assert reason_share(registry, "kv_cache") == pytest.approx(1 / 6)
    assert device(registry, "phasescope_queue_wait_ratio") == pytest.approx(4 / 6)
    waiting = {"model": "m", "engine": "0", "reason": "adapters"}
    assert registry.get_sample_value("phasescope_engine_waiting_requests", waiting) == 3
    assert registry.get_sample_value("phasescope_engine_waiting_requests", {**waiting, "reason": "kv_cache"}) == 1
    # The KV wait is above its threshold too, and capacity comes first; without it, the adapter slots are the wall.
    assert verdicts(registry, "prefill")["capacity"] == 1
    clock, registry = FakeClock(), CollectorRegistry()
    roofline = metrics(clock, registry, kv_cache_capacity_tokens=4096)
    for _ in range(3):
        state = SchedulerState(0, running=2, waiting=3, kv_cache_usage=0.5, reason="kv_cache", waiting_for_adapters=3)
        roofline.record(StepReport(scheduler=state))
        clock.now += 1
    assert reason_share(registry, "kv_cache") == 0.0
    assert verdicts(registry, "prefill")["adapters"] == 1
    assert verdicts(registry, "decode")["adapters"] == 1
    labels = {"model": "m", "engine": "0", "limit": "queue"}
    assert registry.get_sample_value("phasescope_headroom_ratio", labels) == 0.0


def test_why_a_request_waits_is_what_ended_the_steps_admission() -> None:
    # Eight slots, a budget of 2,048 tokens a step.
    assert wait_reason(running=8, max_running=8, scheduled_tokens=8, token_budget=2048, preempted=False) == "slot"
    assert wait_reason(4, 8, scheduled_tokens=2048, token_budget=2048, preempted=False) == "other"
    # Slots and budget left, and still waiting: its next chunk's blocks were not free.
    assert wait_reason(4, 8, scheduled_tokens=4, token_budget=2048, preempted=False) == "kv_cache"
    assert wait_reason(8, 8, scheduled_tokens=8, token_budget=2048, preempted=True) == "kv_cache"


def test_requests_waiting_with_every_slot_taken_wait_for_a_slot_whatever_the_cache() -> None:
    clock, registry = FakeClock(), CollectorRegistry()
    roofline = metrics(clock, registry, kv_cache_capacity_tokens=4096)
    for _ in range(3):
        roofline.record(
            StepReport(scheduler=SchedulerState(0, running=8, waiting=8, kv_cache_usage=0.95, reason="slot"))
        )
        clock.now += 1
    assert reason_share(registry, "slot") == pytest.approx(0.5)
    assert reason_share(registry, "kv_cache") == 0.0
    assert verdicts(registry, "prefill")["queue"] == 1
    assert verdicts(registry, "decode")["capacity"] == 0


def test_a_preemption_makes_both_phases_capacity_bound_for_the_window() -> None:
    clock, registry = FakeClock(), CollectorRegistry()
    roofline = metrics(clock, registry, kv_cache_capacity_tokens=4096)
    roofline.record(StepReport(scheduler=SchedulerState(0, running=4, waiting=0, kv_cache_usage=0.5)))
    clock.now += 1
    roofline.record(StepReport(iteration=EngineIteration(0, (), preemptions=1)))
    roofline.record(
        StepReport(
            scheduler=SchedulerState(
                0, running=3, waiting=1, kv_cache_usage=0.7, reason=wait_reason(3, 8, 3, 2048, True)
            )
        )
    )
    assert device(registry, "phasescope_preemptions_in_window") == 1
    assert verdicts(registry, "decode")["capacity"] == 1
    # The waiting request of that sample waited for blocks: its sequence was preempted for them.
    assert reason_share(registry, "kv_cache") == pytest.approx(1 / 4)
    # Past the window, nothing says capacity any more.
    clock.now += 11
    roofline.record(StepReport(scheduler=SchedulerState(0, running=3, waiting=0, kv_cache_usage=0.7)))
    assert device(registry, "phasescope_preemptions_in_window") == 0
    assert verdicts(registry, "decode")["capacity"] == 0


def test_headroom_names_the_nearest_limit() -> None:
    clock, registry = FakeClock(), CollectorRegistry()
    roofline = metrics(clock, registry)
    clock.now += 10
    # 6e11 bytes over 10 s against 100 GB/s: saturation 0.6 of the 0.8 limit leaves 0.25; KV 0.3 of 0.9 leaves 0.67.
    roofline.record(StepReport(scheduler=SchedulerState(0, running=1, waiting=0, kv_cache_usage=0.3)))
    roofline.record(StepReport(step=decode_step(1, flops=1e6, read_bytes=6e11, elapsed=5.0)))
    labels = {"model": "m", "engine": "0", "limit": "bandwidth"}
    assert registry.get_sample_value("phasescope_headroom_ratio", labels) == pytest.approx(0.25)


def test_cost_per_million_tokens_and_idle_cost_when_priced() -> None:
    clock, registry = FakeClock(), CollectorRegistry()
    roofline = metrics(clock, registry, cost_per_hour=3.6)
    clock.now += 10
    # Only decode ran: it carries the window's whole $0.01 over its 100 tokens = $100 per million.
    for _ in range(100):
        roofline.record(StepReport(step=decode_step(1, flops=1e9, read_bytes=1e6, elapsed=0.01)))
    assert gauge(registry, "phasescope_cost_per_million_tokens", "decode") == pytest.approx(100.0)
    assert gauge(registry, "phasescope_cost_per_million_tokens", "prefill") is None
    # 1e11 FLOPs over 10 s against 1 TFLOP/s: MFU 1 %, so 99 % of $3.60 an hour pays for idle compute.
    assert device(registry, "phasescope_idle_cost_per_hour") == pytest.approx(3.564)


def test_without_a_price_there_are_no_cost_series() -> None:
    clock, registry = FakeClock(), CollectorRegistry()
    metrics(clock, registry).record(StepReport(step=decode_step(1)))
    assert device(registry, "phasescope_idle_cost_per_hour") is None


def test_the_interference_ledger_charges_mixed_steps_against_decode_only_ones() -> None:
    from phasescope.telemetry.step.interference import Interference, InterferenceLedger

    ledger = InterferenceLedger()
    # Decode-only steps of batch 4 take 50 ms: the reference. They add nothing.
    for _ in range(3):
        ledger.record(decode_step(4, elapsed=0.05), decode_share_seconds=0.05)
    assert ledger.read(0) == Interference()
    # A 300-token chunk beside the 4 decodes makes the step 200 ms: all of it stalled, 150 ms extra.
    ledger.record(StepRecord(0, 1, 300, 4, 4, 0.2), decode_share_seconds=0.02)
    assert ledger.read(0).stalled_seconds == pytest.approx(0.2)
    assert ledger.read(0).extra_seconds == pytest.approx(0.15)
    # A batch never seen decode-only is compared with the nearest batch seen (4), not with nothing.
    ledger.record(StepRecord(0, 1, 300, 5, 5, 0.25), decode_share_seconds=0.02)
    assert ledger.read(0).extra_seconds == pytest.approx(0.15 + 0.2)
    # Prefill-only steps stall no decode; another engine's totals are its own.
    ledger.record(StepRecord(0, 2, 600, 0, 0, 0.5), decode_share_seconds=0.0)
    assert ledger.read(0).stalled_seconds == pytest.approx(0.45)
    assert ledger.read(1) == Interference()


def test_before_any_decode_only_step_the_roofline_split_is_the_reference() -> None:
    from phasescope.telemetry.step.interference import InterferenceLedger

    ledger = InterferenceLedger()
    ledger.record(StepRecord(0, 1, 300, 4, 4, 0.2), decode_share_seconds=0.03)
    assert ledger.read(0).extra_seconds == pytest.approx(0.17)


def test_the_aggregator_advances_its_ledger_whatever_its_sinks() -> None:
    # Guards the defect of per-request interference living in the Prometheus sink: without a sink,
    # a request still reads its interference.
    aggregator = StepAggregator(COST, "float32", PEAKS, window_seconds=10.0, clock=FakeClock())
    aggregator.record(StepReport(step=decode_step(2, elapsed=0.05)))
    aggregator.record(StepReport(step=StepRecord(0, 1, 100, 2, 2, 0.08)))
    assert aggregator.read_interference(0).stalled_seconds == pytest.approx(0.08)
    assert aggregator.read_interference(0).extra_seconds == pytest.approx(0.03)


def test_every_sink_hears_each_report_with_the_attribution_made_once() -> None:
    heard: list[str] = []

    class Listening(StepSink):
        def step(self, step: StepRecord, cost: StepCost) -> None:
            heard.append(f"step {cost.shares['decode'].tokens}")

        def queue(self, state: SchedulerState) -> None:
            heard.append(f"queue {state.running}/{state.waiting}")

    aggregator = StepAggregator(COST, "float32", PEAKS, sinks=(Listening(),), clock=FakeClock())
    aggregator.record(StepReport(step=decode_step(3)))
    aggregator.record(StepReport(scheduler=SchedulerState(0, running=3, waiting=1, kv_cache_usage=0.1)))
    aggregator.record(
        StepReport(iteration=EngineIteration(0, (0.01,), 0))
    )  # a sink that ignores iterations needs no method
    assert heard == ["step 3", "queue 3/1"]


def test_a_verify_step_counts_its_drafts_and_acceptance_beside_the_positions_it_computed() -> None:
    clock, registry = FakeClock(), CollectorRegistry()
    steps = metrics(clock, registry)
    # 4 sequences, k = 3: 4 × (1 + 3) = 16 positions verified; 7 of the 12 drafts accepted (4, 2 and 1 at
    # positions 0, 1 and 2), 5 rejected.
    verify = SpeculativeStep(drafts=4, drafted_tokens=12, accepted_tokens=7, accepted_by_position=(4, 2, 1),
                             drafted_by_position=(4, 4, 4))  # fmt: skip
    step = StepRecord(0, 0, 0, 4, 16, 0.05, speculative=verify)
    assert step.kind == "decode"  # several positions per sequence: still decode, never prefill or mixed
    assert verify.rejected_tokens == 5
    steps.record(StepReport(step=step))
    steps.record(StepReport(step=decode_step(4)))  # a plain decode step: 4 positions, 4 tokens
    labels = {"model": "m", "engine": "0"}
    assert registry.get_sample_value("phasescope_engine_step_tokens_total", {**labels, "phase": "decode"}) == 20
    assert registry.get_sample_value("phasescope_speculative_drafts_total", labels) == 4
    assert registry.get_sample_value("phasescope_speculative_drafted_tokens_total", labels) == 12
    assert registry.get_sample_value("phasescope_speculative_accepted_tokens_total", labels) == 7
    by_position = [
        registry.get_sample_value("phasescope_speculative_accepted_tokens_by_position_total", {**labels, "position": p})
        for p in "012"
    ]
    assert by_position == [4, 2, 1]


def test_the_window_gives_each_speculating_engines_acceptance_and_tokens_per_verify_step() -> None:
    clock, registry = FakeClock(), CollectorRegistry()
    steps = metrics(clock, registry, engines=2)
    # Engine 0: two verify steps of 4 sequences, k = 3: 8 drafts, 24 drafted, 15 accepted.
    for accepted in (7, 8):
        verify = SpeculativeStep(drafts=4, drafted_tokens=12, accepted_tokens=accepted)
        steps.record(StepReport(step=StepRecord(0, 0, 0, 4, 16, 0.05, speculative=verify)))
    steps.record(StepReport(step=decode_step(4, engine=1)))  # engine 1 does not speculate
    _, views = steps.views()
    first, second = views
    assert second.speculation is None
    assert first.speculation is not None
    assert first.speculation.acceptance_rate == pytest.approx(15 / 24)
    # 1 + 15 accepted ÷ 8 drafts: each sequence emits 2.875 tokens a verify step.
    assert first.speculation.mean_acceptance_length == pytest.approx(2.875)
