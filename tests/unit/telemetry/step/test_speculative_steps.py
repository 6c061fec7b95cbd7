"""Verify steps under speculative decoding: what they computed, what they emitted, what the drafter cost, and
whether speculation pays (phasescope.telemetry.step.attribution and .window)."""

import pytest
from prometheus_client import CollectorRegistry

from phasescope.telemetry.hardware.peaks import HardwarePeaks
from phasescope.telemetry.model.cost import model_cost_from_config
from phasescope.telemetry.model.speculation import Drafter
from phasescope.telemetry.step.aggregator import StepAggregator
from phasescope.telemetry.step.attribution import attribute_step
from phasescope.telemetry.step.prometheus import StepMetrics
from phasescope.telemetry.step.records import SpeculativeStep, StepRecord, StepReport

# A toy device: 100 GB/s and 1 TFLOP/s, ridge point 10 FLOP/byte; a 4 MB model.
PEAKS = HardwarePeaks("toy", 100e9, {"fp32": 1e12}, "measured", "toy device")
BANDWIDTH = PEAKS.memory_bandwidth_bytes_per_second
FLOPS = 1e12
COST = model_cost_from_config(
    {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2},
    parameter_count=1_000_000,
    dtype="float32",
)
K = 3


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def device(registry: CollectorRegistry, name: str) -> float | None:
    return registry.get_sample_value(name, {"model": "m", "engine": "0"})


def gauge(registry: CollectorRegistry, name: str, phase: str) -> float | None:
    return registry.get_sample_value(name, {"model": "m", "engine": "0", "phase": phase})


def verify_step(
    sequences: int, accepted: int, context: int = 0, elapsed: float = 0.05, engine_flops: float | None = None
) -> StepRecord:
    """A decode-only verify step: each sequence checks K drafts and one position of its own."""
    drafted = sequences * K
    return StepRecord(
        0,
        0,
        0,
        sequences,
        sequences * (K + 1),
        elapsed,
        flops=engine_flops,
        kv_cache_tokens=context,
        speculative=SpeculativeStep(sequences, drafted, accepted),
    )


def test_a_verify_step_is_decode_and_emits_its_positions_less_the_rejected_drafts() -> None:
    step = verify_step(4, accepted=6)
    assert step.kind == "decode"
    cost = attribute_step(step, COST, BANDWIDTH, FLOPS, Drafter(K))
    decode = cost.shares["decode"]
    assert cost.shares["prefill"].tokens == 0
    assert decode.tokens == 16  # 4 sequences × (3 drafts + 1)
    assert decode.emitted_tokens == 10  # 16 − (12 drafted − 6 accepted)
    assert cost.speculative is not None
    assert cost.speculative.emitted_tokens == 10
    # Useful FLOPs are the emitted positions' share of the verify work; the rejected drafts' are wasted.
    verify = cost.speculative.useful_flops + cost.speculative.wasted_flops
    assert cost.speculative.useful_flops == pytest.approx(verify * 10 / 16)
    assert verify == pytest.approx(COST.decode_flops(16))


def test_a_verify_step_ignores_the_engines_estimate_which_counts_it_as_prefill() -> None:
    engine_estimate = 1.0  # what vLLM's estimate would say: far from the positions' real FLOPs
    cost = attribute_step(verify_step(4, accepted=6, engine_flops=engine_estimate), COST, BANDWIDTH, FLOPS, Drafter(K))
    assert cost.flops == pytest.approx(COST.decode_flops(16))
    # Without speculation the engine's estimate is the step's total, as before.
    plain = StepRecord(0, 0, 0, 4, 4, 0.05, flops=engine_estimate)
    assert attribute_step(plain, COST, BANDWIDTH, FLOPS).flops == engine_estimate


def test_verifying_k_drafts_raises_decodes_intensity_about_k_plus_one_times() -> None:
    # Weights read once for every position: at a short context, FLOPs per byte grow with the positions.
    plain = attribute_step(StepRecord(0, 0, 0, 2, 2, 0.05), COST, BANDWIDTH, FLOPS).shares["decode"]
    verify = attribute_step(verify_step(2, accepted=6), COST, BANDWIDTH, FLOPS, Drafter(K)).shares["decode"]
    ratio = (verify.flops / verify.moved_bytes) / (plain.flops / plain.moved_bytes)
    assert ratio == pytest.approx(K + 1, rel=0.01)


def test_each_position_attends_to_its_sequences_context() -> None:
    context = 1000
    cost = attribute_step(verify_step(1, accepted=3, context=context), COST, BANDWIDTH, FLOPS, Drafter(K))
    assert cost.flops == pytest.approx(COST.decode_flops(K + 1, context * (K + 1)))


def test_a_draft_model_costs_k_passes_of_its_own_and_an_ngram_drafter_nothing() -> None:
    drafter_cost = model_cost_from_config(
        {"hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 1},
        parameter_count=100_000,
        dtype="float32",
    )
    step = verify_step(1, accepted=3)
    ngram = attribute_step(step, COST, BANDWIDTH, FLOPS, Drafter(K))
    drafted = attribute_step(step, COST, BANDWIDTH, FLOPS, Drafter(K, drafter_cost))
    assert ngram.speculative is not None
    assert drafted.speculative is not None
    assert ngram.speculative.drafter_flops == 0.0
    assert ngram.speculative.drafter_seconds == 0.0
    assert drafted.speculative.drafter_flops == pytest.approx(K * drafter_cost.decode_flops(1))
    # Its bytes are the decode's too: the device read them.
    assert drafted.read_bytes == pytest.approx(ngram.read_bytes + drafted.speculative.drafter_bytes)
    # A drafter as large as the target, memory-bound, takes k of the k + 1 weight reads of the step's time.
    self_drafted = attribute_step(step, COST, BANDWIDTH, FLOPS, Drafter(K, COST))
    assert self_drafted.speculative is not None
    assert self_drafted.speculative.drafter_seconds / 0.05 == pytest.approx(K / (K + 1), rel=0.01)


def test_a_draft_cost_ratio_is_the_calculator_s_alone_with_no_work_to_attribute() -> None:
    with pytest.raises(ValueError, match="draft cost ratio is the calculator's"):
        attribute_step(verify_step(1, accepted=3), COST, BANDWIDTH, FLOPS, Drafter(K, cost_ratio=0.05))


def record(steps: list[StepRecord], clock: FakeClock, registry: CollectorRegistry) -> None:
    aggregator = StepAggregator(COST, "float32", PEAKS, window_seconds=10.0, clock=clock, drafter=Drafter(K))
    step_metrics = StepMetrics("m", aggregator)
    aggregator.add_sink(step_metrics)
    registry.register(step_metrics)
    for step in steps:
        clock.now += step.elapsed_seconds
        aggregator.record(StepReport(step=step))


def test_speculation_pays_at_batch_one_with_good_acceptance() -> None:
    clock, registry = FakeClock(), CollectorRegistry()
    record([verify_step(1, accepted=2) for _ in range(10)], clock, registry)
    assert device(registry, "phasescope_speculative_acceptance_ratio") == pytest.approx(2 / 3)
    assert device(registry, "phasescope_speculative_mean_acceptance_length") == pytest.approx(3.0)
    # Memory-bound: four positions cost about one plain step, and emit three tokens.
    assert device(registry, "phasescope_speculative_gain_ratio") == pytest.approx(3.0, rel=0.05)
    assert (
        registry.get_sample_value("phasescope_speculative_reading", {"model": "m", "engine": "0", "reading": "paying"})
        == 1.0
    )
    # Tokens per second are what came out; positions computed include the rejected drafts.
    assert gauge(registry, "phasescope_tokens_per_second", "decode") == pytest.approx(30 / 0.5)
    assert gauge(registry, "phasescope_computed_tokens_per_second", "decode") == pytest.approx(40 / 0.5)
    assert device(registry, "phasescope_speculative_useful_flops_ratio") == pytest.approx(3 / 4)
    assert device(registry, "phasescope_speculative_drafter_time_ratio") == 0.0


def reading(registry: CollectorRegistry, name: str) -> float | None:
    return registry.get_sample_value("phasescope_speculative_reading", {"model": "m", "engine": "0", "reading": name})


def test_speculation_stops_paying_when_the_drafts_are_rejected() -> None:
    clock, registry = FakeClock(), CollectorRegistry()
    record([verify_step(1, accepted=0) for _ in range(10)], clock, registry)
    gain = device(registry, "phasescope_speculative_gain_ratio")
    assert gain is not None
    assert gain < 1.0
    assert reading(registry, "acceptance") == 1.0


def test_speculation_stops_paying_when_verify_steps_are_compute_bound() -> None:
    # 512 sequences × 4 positions: 2,048 tokens through the weights, far past the toy device's ridge point.
    clock, registry = FakeClock(), CollectorRegistry()
    record([verify_step(512, accepted=512, elapsed=0.005) for _ in range(10)], clock, registry)
    gain = device(registry, "phasescope_speculative_gain_ratio")
    assert gain is not None
    assert gain < 1.0
    assert reading(registry, "compute") == 1.0
    bound = registry.get_sample_value(
        "phasescope_bound", {"model": "m", "engine": "0", "phase": "decode", "verdict": "compute"}
    )
    assert bound == 1.0


def test_without_speculation_there_is_no_speculation_series() -> None:
    clock, registry = FakeClock(), CollectorRegistry()
    record([StepRecord(0, 0, 0, 4, 4, 0.05) for _ in range(10)], clock, registry)
    assert device(registry, "phasescope_speculative_gain_ratio") is None
    assert gauge(registry, "phasescope_tokens_per_second", "decode") == gauge(
        registry, "phasescope_computed_tokens_per_second", "decode"
    )
