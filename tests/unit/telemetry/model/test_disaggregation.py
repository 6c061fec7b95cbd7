"""Disaggregated prefill and decode in the calculator: each pool's capacity, the GPUs a rate needs, the KV transfer.

Every figure is derived by hand in the comments, on the H100 SXM's datasheet peaks (3.35e12 B/s,
989e12 FLOP/s bf16, 80 GiB of which vLLM uses 0.9: 77,309,411,328 bytes).
"""

from __future__ import annotations

import math

import pytest

from phasescope.telemetry.hardware.peaks import HardwarePeaks, lookup_device
from phasescope.telemetry.model.cost import ModelCost, model_cost_from_config, model_cost_from_numbers
from phasescope.telemetry.model.disaggregation import (
    LINKS,
    Link,
    disaggregation,
    instances_needed,
    kv_transfer_seconds,
)
from phasescope.telemetry.model.roofline import compute_bound_batch_size, decode_step, prefill_time
from support.model_configs import LLAMA_3_1_70B


def datasheet(name: str) -> HardwarePeaks:
    peaks = lookup_device(name)
    assert peaks is not None, name
    return peaks


H100 = datasheet("h100-sxm")
LLAMA_70B = model_cost_from_config(LLAMA_3_1_70B, None, "bfloat16")
# A 1B dense model without grouped-query attention, its cost written out so every figure is short:
# 16 layers × 16 KV heads × head_dim 128, hidden 2,048, bf16, no separate embedding or LM head.
# KV bytes per token = 2 × 16 × 16 × 128 × 2 = 131,072.
SMALL_MHA = ModelCost(
    parameter_count=1_000_000_000,
    bytes_per_parameter=2,
    num_layers=16,
    num_kv_heads=16,
    head_dim=128,
    hidden_size=2048,
    kv_bytes_per_element=2,
)


def test_the_link_table_is_each_port_s_bandwidth_in_one_direction() -> None:
    # NVLink 4: 900 GB/s both directions together (H100 datasheet) = 450 GB/s each way. 400 Gb/s ÷ 8 = 50 GB/s
    # (InfiniBand NDR, 400 GbE); 200 Gb/s = 25 GB/s. PCIe x16: 16 lanes × 32 (16) GT/s × 128/130 ÷ 8.
    bandwidths = {name: link.bandwidth_bytes_per_second for name, link in LINKS.items()}
    assert bandwidths == {
        "nvlink4": 450e9,
        "ib-ndr": 50e9,
        "roce-400g": 50e9,
        "roce-200g": 25e9,
        "pcie5-x16": pytest.approx(63.015e9, rel=1e-4),
        "pcie4-x16": pytest.approx(31.508e9, rel=1e-4),
    }
    assert all(link.source for link in LINKS.values())


def test_llama_70b_s_kv_cache_for_a_4096_token_prompt_takes_26_8_ms_over_400_gbps() -> None:
    # 2 (K and V) × 80 layers × 8 KV heads × 128 head_dim × 2 bytes = 327,680 bytes per token;
    # 4,096 tokens: 1,342,177,280 bytes ≈ 1.34 GB; ÷ 50e9 B/s (400 Gb/s) = 26.84 ms on one GPU's port.
    assert LLAMA_70B.kv_cache_bytes_per_token == 2 * 80 * 8 * 128 * 2 == 327_680
    assert kv_transfer_seconds(LLAMA_70B, 4096, LINKS["ib-ndr"]) == pytest.approx(1_342_177_280 / 50e9)
    assert kv_transfer_seconds(LLAMA_70B, 4096, LINKS["ib-ndr"]) == pytest.approx(0.02684, abs=1e-5)
    # At TP 4 each GPU holds 2 of the 8 KV heads, a quarter of the bytes, and sends it over its own port
    # at the same time as the others: 335,544,320 bytes ÷ 50e9 = 6.71 ms.
    assert kv_transfer_seconds(LLAMA_70B.sharded(4, 1), 4096, LINKS["ib-ndr"]) == pytest.approx(335_544_320 / 50e9)


def test_llama_70b_at_tp_4_prefill_binds_ttft_and_the_pools_balance_at_1_42_prefill_gpus_per_decode_gpu() -> None:
    # Prefill of 4,096 tokens on each of 4 H100s: FLOPs = (2 × 68,452,360,192 non-embedding, non-head
    # parameters × 4,096 + 2 × 1,050,673,152 LM head (one token) + 4 × 80 × 8,192 × 4,096² ÷ 2 attention)
    # ÷ 4 = (560,761,734,692,864 + 2,101,346,304 + 21,990,232,555,520) ÷ 4 = 145,688,517,148,672;
    # ÷ 989e12 = 147.31 ms, compute-bound (the bytes, 35.3 GB of weights + 335.5 MB of KV, take 10.6 ms).
    # 1 ÷ 147.31 ms = 6.788 prompts/s per instance of 4 GPUs, 1.697 per GPU.
    # Decode at context 4,096 + 512 ÷ 2 = 4,352: the KV cache holds 479,505 tokens per GPU
    # (docs/roofline.md, "The third wall") = 110 sequences of 4,352, and at this context decode never
    # turns compute-bound: batch 110. Step = (35,276,853,248 + 110 × 4,352 × 81,920 = 39,216,742,400)
    # ÷ 3.35e12 = 22.237 ms: 4,946.7 tok/s ÷ 512 = 9.662 requests/s per instance, 2.415 per GPU.
    # Ratio = 9.662 ÷ 6.788 = 1.423 prefill GPUs per decode GPU. At 30 requests/s: ⌈30 ÷ 6.788 = 4.42⌉
    # = 5 prefill instances (20 GPUs), ⌈30 ÷ 9.662 = 3.10⌉ = 4 decode instances (16 GPUs).
    # Transfer 6.71 ms per GPU (above) < 147.31 ms: prefill binds; TTFT floor = 154.02 ms.
    cost = LLAMA_70B.sharded(4, 1)
    result = disaggregation(cost, H100, "bf16", 4096, 512, 30, LINKS["ib-ndr"])
    assert cost.prefill_flops(4096) == 145_688_517_148_672
    assert result.prefill_seconds == pytest.approx(145_688_517_148_672 / 989e12)
    assert result.prefill_bound == "compute"
    assert result.prefill_requests_per_second_per_instance == pytest.approx(989e12 / 145_688_517_148_672)
    assert result.prefill_requests_per_second_per_gpu == pytest.approx(6.788 / 4, rel=1e-3)
    assert (result.decode_context_length, result.decode_batch_size, result.decode_batch_limit) == (
        4352,
        110,
        "capacity",
    )
    step_seconds = (35_276_853_248 + 39_216_742_400) / 3.35e12
    assert result.decode_tokens_per_second_per_instance == pytest.approx(110 / step_seconds)
    assert result.decode_requests_per_second_per_instance == pytest.approx(110 / step_seconds / 512)
    assert result.decode_requests_per_second_per_gpu == pytest.approx(9.662 / 4, rel=1e-3)
    assert result.prefill_to_decode_gpu_ratio == pytest.approx(1.423, abs=1e-3)
    assert (result.prefill_instances, result.prefill_gpus, result.decode_instances, result.decode_gpus) == (
        5,
        20,
        4,
        16,
    )
    assert (result.kv_bytes_per_request, result.device_kv_bytes_per_request) == (1_342_177_280, 335_544_320)
    assert result.kv_transfer_seconds == pytest.approx(0.0067108864)
    assert result.ttft_bound == "prefill"
    assert result.ttft_floor_seconds == pytest.approx(result.prefill_seconds + 0.0067108864)


def test_a_small_model_s_transfer_binds_ttft_on_a_slow_link_and_its_prefill_on_nvlink() -> None:
    # SMALL_MHA, a 1,024-token prompt on one H100. FLOPs = 2 × 1e9 × 1,024 + 4 × 16 × 2,048 × 1,024² ÷ 2
    # = 2,048,000,000,000 + 68,719,476,736 = 2,116,719,476,736; ÷ 989e12 = 2.140 ms. Bytes = 2e9 of weights +
    # 1,024 × 131,072 of KV = 2,134,217,728; ÷ 3.35e12 = 0.637 ms: compute-bound, 2.140 ms.
    # The prompt's KV, 134,217,728 bytes, over RoCE 200 GbE (25e9 B/s): 5.369 ms > 2.140 ms, the transfer
    # binds (TTFT floor 7.509 ms); over NVLink 4 (450e9 B/s): 0.298 ms < 2.140 ms, the prefill binds.
    # A small model with full multi-head attention moves as many KV bytes per token as a large one with
    # grouped-query attention, but prefills them far faster.
    prefill_seconds = 2_116_719_476_736 / 989e12
    slow = disaggregation(SMALL_MHA, H100, "bf16", 1024, 256, 100, LINKS["roce-200g"])
    assert slow.prefill_seconds == pytest.approx(prefill_seconds)
    assert slow.prefill_bound == "compute"
    assert slow.kv_bytes_per_request == slow.device_kv_bytes_per_request == 1024 * 131_072 == 134_217_728
    assert slow.kv_transfer_seconds == pytest.approx(134_217_728 / 25e9)
    assert slow.ttft_bound == "transfer"
    assert slow.ttft_floor_seconds == pytest.approx(prefill_seconds + 134_217_728 / 25e9)
    assert slow.ttft_floor_seconds == pytest.approx(0.007509, abs=1e-6)
    fast = disaggregation(SMALL_MHA, H100, "bf16", 1024, 256, 100, LINKS["nvlink4"])
    assert fast.kv_transfer_seconds == pytest.approx(134_217_728 / 450e9)
    assert fast.ttft_bound == "prefill"


def test_the_ratio_is_decode_capacity_over_prefill_capacity_and_each_pool_rounds_up() -> None:
    # SMALL_MHA, 1,024-token prompts and 256 output tokens at 100 requests/s on H100s.
    # Prefill: 1 ÷ 2.140 ms = 467.23 requests/s. Decode at context 1,024 + 128 = 1,152: usable 77,309,411,328
    # − 2e9 of weights − reserve (2 GiB + 8,192 tokens × 12 widths × 2,048 × 2 bytes = 2,550,136,832)
    # = 72,759,274,496 bytes = 555,109 tokens of 131,072 bytes = 481 sequences of 1,152. Each sequence's
    # KV read (151 MB) outweighs its FLOPs (2.15 GFLOP: 14 FLOP/byte, under the 295 ridge): never
    # compute-bound, batch 481. Step = (2e9 + 481 × 1,152 × 131,072 = 72,628,568,064) ÷ 3.35e12
    # = 22.277 ms: 21,591.6 tok/s ÷ 256 = 84.342 requests/s.
    # Ratio = 84.342 ÷ 467.23 = 0.1805: one prefill GPU keeps 5.5 decode GPUs busy. At 100 requests/s:
    # ⌈100 ÷ 467.23⌉ = 1 prefill GPU, ⌈100 ÷ 84.342 = 1.19⌉ = 2 decode GPUs.
    result = disaggregation(SMALL_MHA, H100, "bf16", 1024, 256, 100, LINKS["ib-ndr"])
    assert result.prefill_requests_per_second_per_instance == pytest.approx(989e12 / 2_116_719_476_736)
    assert (result.decode_batch_size, result.decode_batch_limit) == (481, "capacity")
    decode_per_second = 481 / ((2e9 + 72_628_568_064) / 3.35e12) / 256
    assert result.decode_requests_per_second_per_instance == pytest.approx(decode_per_second)
    assert decode_per_second == pytest.approx(84.342, abs=1e-3)
    assert result.prefill_to_decode_gpu_ratio == pytest.approx(decode_per_second * 2_116_719_476_736 / 989e12)
    assert result.prefill_to_decode_gpu_ratio == pytest.approx(0.1805, abs=1e-4)
    assert (result.gpus_per_instance, result.prefill_gpus, result.decode_gpus) == (1, 1, 2)


def test_instances_needed_is_the_ceiling_and_an_exact_multiple_needs_no_extra_instance() -> None:
    assert instances_needed(30, 6.788) == 5  # 4.42
    assert instances_needed(10, 2.5) == 4
    # Guards the quotient's rounding: 2.1 ÷ 0.3 = 7.000000000000001 in floating point, yet 7 suffice.
    assert 2.1 / 0.3 > 7
    assert instances_needed(2.1, 0.3) == 7
    assert instances_needed(2.1000001, 0.3) == 8


def test_the_decode_batch_is_the_compute_bound_batch_when_the_compute_roof_comes_before_the_kv_cache() -> None:
    # SMALL_MHA with one KV head of 64: 2 × 16 × 1 × 64 × 2 = 4,096 KV bytes per token. At context 1,152 a
    # sequence reads 4,718,592 bytes of KV (1.4085 µs at 3.35e12 B/s) for 2,150,994,944 FLOPs (2.1749 µs at
    # 989e12 FLOP/s), so B × 2.1749 µs ≥ 597.01 µs (the 2 GB of weights) + B × 1.4085 µs from B = 779.002:
    # batch 780, long before the 72.76 GB of KV room (15,419 sequences) fills. Compute binds; a larger
    # batch would add no tok/s, only latency.
    cost = ModelCost(
        parameter_count=1_000_000_000,
        bytes_per_parameter=2,
        num_layers=16,
        num_kv_heads=1,
        head_dim=64,
        hidden_size=2048,
        kv_bytes_per_element=2,
    )
    result = disaggregation(cost, H100, "bf16", 1024, 256, 100, LINKS["ib-ndr"])
    bound_at = compute_bound_batch_size(cost, H100, "bf16", 1152)
    assert bound_at == 780
    assert (result.decode_batch_size, result.decode_batch_limit) == (bound_at, "compute")
    # On the compute roof the tok/s are the roof's: peak FLOP/s ÷ FLOPs per token.
    assert result.decode_tokens_per_second_per_instance == pytest.approx(989e12 / cost.flops_per_token(1152), rel=1e-12)
    assert decode_step(cost, H100, "bf16", bound_at, 1152).bound == "compute"


def test_pipeline_stages_add_to_the_prompt_s_latency_but_not_to_a_full_pipeline_s_rate() -> None:
    # Llama 70B at TP 2 × PP 2 holds on each GPU what TP 4 does (half the layers × 4 of the 8 KV heads):
    # the same 147.31 ms stage. One prompt goes through both stages: 294.6 ms to its first token; a full
    # pipeline still finishes one prompt per stage time. The KV shards leave from every stage at once.
    cost = LLAMA_70B.sharded(2, 2)
    stage_seconds, _ = prefill_time(cost, H100, "bf16", 4096)
    result = disaggregation(cost, H100, "bf16", 4096, 512, 30, LINKS["ib-ndr"])
    assert result.prefill_seconds == pytest.approx(2 * stage_seconds)
    assert result.prefill_requests_per_second_per_instance == pytest.approx(1 / stage_seconds)
    assert result.gpus_per_instance == 4
    assert result.kv_transfer_seconds == pytest.approx(335_544_320 / 50e9)


@pytest.mark.parametrize(
    ("cost", "prompt_tokens", "output_tokens", "rate", "bandwidth", "message"),
    [
        (model_cost_from_numbers(8_000_000_000, "bf16"), 1024, 256, 1.0, 50e9, "no KV bytes per token"),
        (LLAMA_70B, 1024, 256, 1.0, 50e9, "the weights do not fit"),
        (SMALL_MHA, 1024, 0, 1.0, 50e9, "at least 1"),
        (SMALL_MHA, 1024, 256, 0.0, 50e9, "request rate"),
        (SMALL_MHA, 1024, 256, math.nan, 50e9, "request rate"),
        (SMALL_MHA, 1024, 256, 1.0, 0.0, "link bandwidth"),
        (SMALL_MHA, 10_000_000, 256, 1.0, 50e9, "holds no sequence of 10,000,128 tokens"),
    ],
)
def test_nothing_to_size_is_refused_saying_why(
    cost: ModelCost, prompt_tokens: int, output_tokens: int, rate: float, bandwidth: float, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        disaggregation(cost, H100, "bf16", prompt_tokens, output_tokens, rate, Link("test", bandwidth, "test"))


def test_a_device_without_a_memory_figure_is_refused() -> None:
    peaks = HardwarePeaks("toy", 1e12, {"bf16": 4e12}, "flag")
    with pytest.raises(ValueError, match="no memory figure"):
        disaggregation(SMALL_MHA, peaks, "bf16", 1024, 256, 1.0, LINKS["ib-ndr"])
