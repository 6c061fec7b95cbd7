"""The third wall: whether the weights fit, the KV cache beside them, and which wall a growing batch hits.

Every figure is derived by hand in the comments. Device memory is the datasheet's "GB" read as GiB
(an H100 SXM's 80 GB is 80 × 2³⁰ = 85,899,345,920 bytes); vLLM may use 0.9 of it. The reserve for
activations and runtime is `activation_reserve`'s estimate: 2 GiB outside PyTorch, plus a profiled
forward pass of 8,192 tokens × (2 + 10 ÷ TP) hidden widths × 2 bytes (a flat 1 GiB without a shape).
"""

from __future__ import annotations

import pytest

from phasescope.telemetry.hardware.peaks import DATASHEET, HardwarePeaks, lookup_device
from phasescope.telemetry.model.capacity import activation_reserve, binding_wall, capacity
from phasescope.telemetry.model.cost import model_cost_from_config, model_cost_from_numbers
from phasescope.telemetry.model.roofline import compute_bound_batch_size, roofline
from support.model_configs import LLAMA_3_1_70B, MIXTRAL_8X7B

GIB = 2**30
H100 = 80 * GIB
USABLE = 0.9 * H100  # 77,309,411,328 bytes


def h100() -> HardwarePeaks:
    peaks = lookup_device("h100-sxm")
    assert peaks is not None
    return peaks


def test_every_gpu_row_has_its_memory_and_a_mig_slice_its_share() -> None:
    assert all(peaks.memory_bytes for peaks in DATASHEET.values())
    assert h100().memory_bytes == H100
    assert DATASHEET["h200"].memory_bytes == 141 * GIB
    # A MIG 3g.40gb holds 4 of the H100's 8 memory slices: half of its 80 GiB.
    mig = lookup_device("NVIDIA H100 80GB HBM3 MIG 3g.40gb")
    assert mig is not None
    assert mig.memory_bytes == 40 * GIB


def test_70b_in_bf16_does_not_fit_one_h100_and_needs_two() -> None:
    # 70e9 parameters × 2 bytes = 140 GB of weights; one H100 offers 77.3 GB: no.
    # At TP 2: 70 GB + 3.22 GB reserve (2 GiB + the flat 1 GiB) = 73.2 GB ≤ 77.3 GB: yes.
    cost = model_cost_from_numbers(70_000_000_000, "bf16")
    whole = capacity(cost, H100, context_length=4096)
    assert not whole.weights_fit
    assert whole.min_tensor_parallel_size == 2
    assert whole.kv_capacity_tokens is None
    assert capacity(cost.sharded(2, 1), H100, 4096).weights_fit
    # The report has no rows for a deployment that cannot run.
    report = roofline(cost, h100(), "bf16", context_length=4096)
    assert report.rows == ()
    assert report.to_json()["weights_fit"] is False
    assert report.to_json()["min_tensor_parallel_size"] == 2


def test_llama_70b_on_four_h100s_at_4096_is_bound_by_kv_capacity_long_before_compute() -> None:
    # Per GPU: weights 2 × 70,553,706,496 ÷ 4 = 35,276,853,248 bytes; KV 81,920 bytes per token
    # (2 × 80 layers × 2 of the 8 KV heads × 128 × 2 bytes). Reserve 2 GiB + 8,192 × (2 + 10/4) × 8,192 × 2
    # = 2,147,483,648 + 603,979,776 = 2,751,463,424. Left for KV: 77,309,411,328 − 35,276,853,248 − 2,751,463,424
    # = 39,281,094,656 bytes = 479,505 tokens = 117 sequences of 4,096.
    # The derivation, with decimal GB and no reserve: 37 GB ÷ 80 KiB ≈ 450k tokens ≈ 110 sequences.
    cost = model_cost_from_config(LLAMA_3_1_70B, None, "bfloat16").sharded(4, 1)
    assert activation_reserve(cost) == 2 * GIB + 8_192 * 4.5 * 8_192 * 2
    found = capacity(cost, H100, context_length=4096)
    assert found.weights_fit
    assert found.kv_capacity_tokens == 39_281_094_656 // 81_920 == 479_505
    assert found.max_sequences_at_context == 117
    assert found.kv_capacity_tokens == pytest.approx(450_000, rel=0.10)
    assert found.max_sequences_at_context == pytest.approx(110, rel=0.10)
    # Compute would bind only far later (at context 0, batch 296; at 4,096 the KV traffic keeps it away).
    bound_at = compute_bound_batch_size(cost, h100(), "bf16", 4096)
    assert bound_at is None or bound_at > 117
    assert binding_wall(found, bound_at) == "capacity"
    report = roofline(cost, h100(), "bf16", batch_sizes=(64, 128, 256), context_length=4096)
    assert [row.fits_in_kv_capacity for row in report.rows] == [True, False, False]
    assert report.binding_wall == "capacity"
    assert report.capacity_row is not None
    assert report.capacity_row.batch_size == 117
    data = report.to_json()
    assert (data["kv_capacity_tokens"], data["max_sequences_at_context"], data["binding_wall"]) == (
        479_505,
        117,
        "capacity",
    )
    assert data["device_memory_bytes"] == H100


def test_a_small_model_on_a_large_gpu_reaches_the_compute_roof_first() -> None:
    # 1B parameters in bf16 (2 GB) at a 128-token context, with a KV cache of 32 KiB per token
    # (Llama 3.2 1B: 2 × 16 layers × 8 KV heads × 64 × 2 bytes). Compute binds when
    # B × 2 × 1e9 ÷ 989e12 ≥ (2e9 + B × 128 × 32,768) ÷ 3.35e12, i.e. from B ≈ 1,300 (the FLOPs per token
    # here are the bare 2 × parameters); the cache holds ~73 GB ÷ 32 KiB ÷ 128 ≈ 17,000 sequences.
    config = {
        "hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 16,
        "intermediate_size": 8192, "vocab_size": 128_256, "tie_word_embeddings": True,
    }  # fmt: skip
    cost = model_cost_from_config(config, None, "bfloat16")
    found = capacity(cost, H100, context_length=128)
    assert found.max_sequences_at_context is not None
    assert found.max_sequences_at_context > 10_000
    bound_at = compute_bound_batch_size(cost, h100(), "bf16", 128)
    assert bound_at is not None
    assert bound_at < found.max_sequences_at_context
    assert binding_wall(found, bound_at) == "compute"


def test_a_mixture_of_experts_holds_every_expert_and_fp8_weights_hold_one_byte_each() -> None:
    # Mixtral 8x7B keeps all 8 experts resident: 46,702,792,704 × 2 bytes = 93.4 GB > 77.3 GB on one H100,
    # though a token reads only 2 of them; at TP 2, 46.7 GB + reserve fits.
    mixtral = model_cost_from_config(MIXTRAL_8X7B, None, "bfloat16")
    assert mixtral.weight_bytes == 2 * 46_702_792_704
    assert not capacity(mixtral, H100, 4096).weights_fit
    assert capacity(mixtral, H100, 4096).min_tensor_parallel_size == 2
    # Llama 3.1 70B in block-wise FP8: its 68.45e9 linear weights at 1 byte (+ a float32 scale per
    # 128 × 128 block), the 2.1e9 embedding and LM head parameters at 2: 72.7 GB, which with 2.75 GB of
    # reserve fits one H100's 77.3 GB — where bf16 (141 GB) needs two.
    fp8_config = {
        **LLAMA_3_1_70B,
        "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    }
    fp8 = model_cost_from_config(fp8_config, None, "bfloat16")
    assert fp8.weight_bytes == pytest.approx(72.7e9, rel=0.01)
    found = capacity(fp8, H100, 4096)
    assert found.weights_fit
    assert found.min_tensor_parallel_size == 1
    assert not capacity(model_cost_from_config(LLAMA_3_1_70B, None, "bfloat16"), H100, 4096).weights_fit


def test_a_model_whose_weights_do_not_fit_is_bound_by_capacity_not_compute() -> None:
    # Guards a bug: 70B in bf16 on one H100 (140 GB of weights against 77.3 GB usable) has no KV figure
    # and no row, and binding_wall said "compute" — though no batch at all runs: capacity binds first.
    cost = model_cost_from_numbers(70_000_000_000, "bf16")
    found = capacity(cost, H100, context_length=0)
    assert not found.weights_fit
    assert binding_wall(found, compute_bound_batch_size(cost, h100(), "bf16", 0)) == "capacity"
    report = roofline(cost, h100(), "bf16")
    assert report.binding_wall == "capacity"
    assert report.to_json()["binding_wall"] == "capacity"
    # With the model's shape too (Llama 3.1 70B, 141 GB): no KV room at all, the same wall.
    shaped = model_cost_from_config(LLAMA_3_1_70B, None, "bfloat16")
    assert roofline(shaped, h100(), "bf16", context_length=4096).binding_wall == "capacity"
