"""What LoRA adapters add to a step: each distinct adapter's matrices read once, its FLOPs per token, each phase
its own part; and the adapter series that count them."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from prometheus_client import CollectorRegistry

from phasescope.telemetry.hardware.peaks import HardwarePeaks
from phasescope.telemetry.model.adapter import AdapterShape
from phasescope.telemetry.model.cost import model_cost_from_config
from phasescope.telemetry.step.aggregator import StepAggregator
from phasescope.telemetry.step.attribution import adapter_work, attribute_step
from phasescope.telemetry.step.prometheus import StepMetrics
from phasescope.telemetry.step.records import AdapterTokens, StepRecord, StepReport

PEAKS = HardwarePeaks("toy", 100e9, {"fp32": 1e12}, "measured", "toy device")
CONFIG = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2}
COST = model_cost_from_config(CONFIG, parameter_count=1_000_000, dtype="float32")


@dataclass(frozen=True)
class Loaded:
    name: str
    shape: AdapterShape


def shape(megabytes: float, flops_per_token: float) -> AdapterShape:
    return AdapterShape(8, 16.0, ("q_proj", "v_proj"), 2, "F32", int(megabytes * 1e6), flops_per_token)


# Two adapters by their engine ids: 1 MB and 2 MB of matrices, 10 and 20 kFLOP a token.
ADAPTERS = {1: Loaded("sql", shape(1, 10e3)), 2: Loaded("chat", shape(2, 20e3))}


def test_each_distinct_adapter_is_read_once_a_step_and_costs_its_flops_per_token() -> None:
    # 32 decoders: 8 on sql, 4 on chat, the rest on the base model; the step's other work as the cost model says.
    adapters = (AdapterTokens(1, 0, 8), AdapterTokens(2, 0, 4))
    plain = StepRecord(0, 0, 0, 32, 32, 0.05, kv_cache_tokens=3200)
    with_adapters = StepRecord(0, 0, 0, 32, 32, 0.05, kv_cache_tokens=3200, adapters=adapters)
    base = attribute_step(plain, COST, 100e9, 1e12)
    cost = attribute_step(with_adapters, COST, 100e9, 1e12, adapters=ADAPTERS)
    assert cost.read_bytes - base.read_bytes == pytest.approx(1e6 + 2e6)
    assert cost.flops - base.flops == pytest.approx(8 * 10e3 + 4 * 20e3)
    assert cost.shares["decode"].read_bytes == pytest.approx(cost.read_bytes)
    # The cross-check of the engine's estimate stays the base model's.
    assert cost.model_read_bytes == base.model_read_bytes


def test_in_a_mixed_step_an_adapters_bytes_are_shared_by_its_tokens_and_each_phase_pays_its_flops() -> None:
    # sql runs a 96-token chunk and 32 decodes: its 1 MB split 3 : 1, its FLOPs by tokens.
    step = StepRecord(0, 1, 96, 32, 32, 0.05, kv_cache_tokens=3200, adapters=(AdapterTokens(1, 96, 32),))
    work = adapter_work(step, ADAPTERS)
    assert (work.prefill_bytes, work.decode_bytes) == pytest.approx((0.75e6, 0.25e6))
    assert (work.prefill_flops, work.decode_flops) == pytest.approx((96 * 10e3, 32 * 10e3))
    # Sharded over two devices, each reads half.
    assert adapter_work(step, ADAPTERS, devices=2).decode_bytes == pytest.approx(0.125e6)
    # An id the engine does not know (yet) adds nothing.
    assert adapter_work(step, {}).prefill_bytes == 0.0


def test_the_adapter_series_count_each_adapters_flops_bytes_and_steps() -> None:
    registry = CollectorRegistry()
    # Priced at 36 an hour: 0.01 a second.
    aggregator = StepAggregator(COST, "float32", PEAKS, adapters=ADAPTERS, cost_per_hour=36.0)
    metrics = StepMetrics("m", aggregator, adapter_label=lambda name: name if name == "sql" else "other")
    aggregator.add_sink(metrics)
    registry.register(metrics)
    for _ in range(3):
        step = StepRecord(0, 0, 0, 2, 2, 0.01, adapters=(AdapterTokens(1, 0, 1), AdapterTokens(2, 0, 1)))
        aggregator.record(StepReport(step=step))

    def value(name: str, adapter: str) -> float | None:
        return registry.get_sample_value(name, {"model": "m", "adapter": adapter})

    assert value("phasescope_adapter_read_bytes_total", "sql") == pytest.approx(3e6)
    assert value("phasescope_adapter_read_bytes_total", "other") == pytest.approx(6e6)
    assert value("phasescope_adapter_flops_total", "sql") == pytest.approx(3 * 10e3)
    assert value("phasescope_adapter_steps_total", "other") == 3
    # Each 10 ms step shared by its two sequences' tokens: 5 ms each, three times, at 0.01 a second.
    assert value("phasescope_adapter_busy_seconds_total", "sql") == pytest.approx(0.015)
    assert value("phasescope_adapter_cost_total", "sql") == pytest.approx(0.015 * 0.01)
