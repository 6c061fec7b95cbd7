"""The cost model on the configs operators actually serve, each figure derived here from first principles.

The configs are the published `config.json` fields of each model (only the fields the cost
model reads). Known totals (70.55B, 46.70B, 30.53B, 15.71B) are the parameter counts the
checkpoints themselves hold, so the derivation from the config is checked against reality.
"""

import json
import struct
from pathlib import Path

import pytest

from phasescope.telemetry.hardware.peaks import lookup_device
from phasescope.telemetry.model.cost import model_cost_from_config, model_cost_from_folder, parameters_from_config
from phasescope.telemetry.model.roofline import decode_step
from support.model_configs import DEEPSEEK_V2_LITE, GEMMA_3_4B, LLAMA_3_1_8B, LLAMA_3_1_70B, MIXTRAL_8X7B, QWEN3_30B_A3B

# Llama 3.1 8B, derived once for the quantised cases below:
# embeddings 128,256 × 4,096 = 525,336,576 (an untied LM head as many again);
# per layer: q and o 4,096² each, k and v 4,096 × 1,024 each = 41,943,040; MLP 3 × 4,096 × 14,336 = 176,160,768;
# two norms 8,192. The linear projections of 32 layers: 32 × 218,103,808 = 6,979,321,856.
LLAMA_8B_EMBEDDING = 128_256 * 4_096
LLAMA_8B_LINEAR = 32 * (2 * 4_096**2 + 2 * 4_096 * 1_024 + 3 * 4_096 * 14_336)
LLAMA_8B_TOTAL = 2 * LLAMA_8B_EMBEDDING + LLAMA_8B_LINEAR + 32 * 2 * 4_096 + 4_096


def test_llama_3_1_70b_on_four_gpus_is_costed_per_device_like_vllm() -> None:
    # Embeddings 128,256 × 8,192 = 1,050,673,152, untied LM head as many; per layer attention
    # q, o 8,192² and k, v 8,192 × 1,024 = 150,994,944, MLP 3 × 8,192 × 28,672 = 704,643,072, norms 16,384;
    # 80 layers + both embedding matrices + the final norm = 70,553,706,496 (the checkpoint's count).
    embedding = 128_256 * 8_192
    layer = 2 * 8_192**2 + 2 * 8_192 * 1_024 + 3 * 8_192 * 28_672 + 2 * 8_192
    assert 80 * layer + 2 * embedding + 8_192 == 70_553_706_496
    cost = model_cost_from_config(LLAMA_3_1_70B, None, "bfloat16").sharded(4, 1)
    assert cost.parameter_count == 70_553_706_496
    assert cost.weight_bytes == 2 * 70_553_706_496
    # Each of the 4 GPUs holds a quarter of the weights...
    assert cost.device_weight_bytes == 2 * 70_553_706_496 / 4
    # ...and 2 of the 8 KV heads: 2 × 80 layers × 2 heads × 128 × 2 bytes = 81,920 bytes/token (327,680 whole).
    assert cost.kv_cache_bytes_per_token == 327_680
    assert cost.device_kv_cache_bytes_per_token == 81_920
    # FLOPs per decode token: 2 × every weight but the input embedding (a lookup), split over 4 GPUs.
    assert cost.sharded(1, 1).flops_per_token() == 2 * (70_553_706_496 - embedding)
    assert cost.flops_per_token() == 2 * (70_553_706_496 - embedding) / 4
    # On H100 SXMs, batch 1 at context 0: 35.28 GB per GPU ÷ 3.35 TB/s = 10.53 ms per step.
    h100 = lookup_device("h100-sxm")
    assert h100 is not None
    row = decode_step(cost, h100, "bf16", batch_size=1, context_length=0)
    assert row.step_seconds == pytest.approx(2 * 70_553_706_496 / 4 / 3.35e12)
    assert row.bound == "memory"


def test_tensor_parallel_beyond_the_kv_heads_replicates_them() -> None:
    # vLLM keeps at least one KV head per GPU: at TP 16 each of 16 GPUs holds one of the 8 heads' copies.
    cost = model_cost_from_config(LLAMA_3_1_70B, None, "bfloat16")
    assert cost.sharded(16, 1).device_kv_cache_bytes_per_token == 2 * 80 * 1 * 128 * 2
    # Pipeline parallelism divides the layers: 40 of 80 per stage.
    assert cost.sharded(1, 2).device_kv_cache_bytes_per_token == 2 * 40 * 8 * 128 * 2


def test_mixtral_costs_its_active_experts_per_token_and_reads_more_experts_as_the_batch_grows() -> None:
    # Per layer: attention 2 × 4,096² + 2 × 4,096 × 1,024 = 41,943,040; 8 experts of 3 × 4,096 × 14,336 =
    # 176,160,768; router 4,096 × 8; norms 8,192. 32 layers + 2 × 32,000 × 4,096 embeddings + final norm.
    expert = 3 * 4_096 * 14_336
    layer = 41_943_040 + 8 * expert + 4_096 * 8 + 8_192
    embedding = 32_000 * 4_096
    total = 32 * layer + 2 * embedding + 4_096
    assert total == 46_702_792_704  # Mixtral-8x7B's checkpoint
    cost = model_cost_from_config(MIXTRAL_8X7B, None, "bfloat16")
    assert cost.parameter_count == total
    # A token goes through 2 of the 8 experts: 6 idle experts per layer are not its work.
    assert cost.active_parameter_count == total - 32 * 6 * expert == 12_879_925_248
    assert cost.flops_per_token() == 2 * (12_879_925_248 - embedding)
    # One token reads 2 experts per layer; 4 tokens routed uniformly touch 8 × (1 − (6/8)⁴) = 5.47 of them;
    # a large batch reads all 8 — every weight.
    assert cost.weights_read(1) == 2 * 12_879_925_248
    touched = 8 * (1 - 0.75**4)
    assert cost.weights_read(4) == pytest.approx(2 * (total - 32 * (8 - touched) * expert))
    assert cost.weights_read(4096) == pytest.approx(cost.weight_bytes)


def test_qwen3_30b_a3b_is_three_billion_active_of_thirty() -> None:
    # Per layer: q 2,048 × 4,096 and o back, k, v 2,048 × 512 each = 18,874,368; 128 experts of
    # 3 × 2,048 × 768 = 4,718,592; router 2,048 × 128; norms 2 × 2,048 + q/k norms 2 × 128.
    expert = 3 * 2_048 * 768
    layer = 18_874_368 + 128 * expert + 2_048 * 128 + 2 * 2_048 + 2 * 128
    total = 48 * layer + 2 * 151_936 * 2_048 + 2_048
    assert total == 30_532_122_624  # the checkpoint's count
    cost = model_cost_from_config(QWEN3_30B_A3B, None, "bfloat16")
    assert cost.parameter_count == total
    assert cost.active_parameter_count == total - 48 * 120 * expert == 3_353_032_704
    # Attention computes over 32 heads × 128 = 4,096 wide, twice the 2,048 hidden size.
    assert cost.attention_width == 4_096
    assert cost.flops_per_token(1_000) - cost.flops_per_token(0) == 4 * 48 * 1_000 * 4_096


def test_deepseek_style_shared_experts_and_latent_attention() -> None:
    # Latent attention per layer: q 2,048 × 16 × 192; kv_a 2,048 × (512 + 64) + its norm 512;
    # kv_b 512 × 16 × (128 + 128); o 16 × 128 × 2,048. Layer 0 has a dense MLP (3 × 2,048 × 10,944);
    # the other 26: 64 routed + 2 shared experts of 3 × 2,048 × 1,408, and a router 2,048 × 64.
    attention = 2_048 * 16 * 192 + 2_048 * 576 + 512 + 512 * 16 * 256 + 16 * 128 * 2_048
    expert = 3 * 2_048 * 1_408
    norms = 2 * 2_048
    dense_layer = attention + 3 * 2_048 * 10_944 + norms
    moe_layer = attention + 66 * expert + 2_048 * 64 + norms
    total = dense_layer + 26 * moe_layer + 2 * 102_400 * 2_048 + 2_048
    assert total == 15_706_484_224  # DeepSeek-V2-Lite's checkpoint
    counted = parameters_from_config(DEEPSEEK_V2_LITE)
    assert counted.total == total
    cost = model_cost_from_config(DEEPSEEK_V2_LITE, None, "bfloat16")
    # Every token goes through both shared experts and 6 of the 64 routed ones.
    assert cost.active_parameter_count == total - 26 * 58 * expert
    # The cache keeps one 512 + 64 latent per layer, replicated on every tensor-parallel GPU.
    assert cost.kv_cache_bytes_per_token == 27 * 576 * 2
    assert cost.sharded(2, 1).device_kv_cache_bytes_per_token == 27 * 576 * 2


def test_gemma_3_nested_config_with_tied_embeddings() -> None:
    # The language model's shape is under text_config. Per layer: q 2,560 × 2,048 and o back,
    # k, v 2,560 × 1,024 each; MLP 3 × 2,560 × 10,240; four norms 4 × 2,560 and q/k norms 2 × 256.
    layer = 2 * 2_560 * 2_048 + 2 * 2_560 * 1_024 + 3 * 2_560 * 10_240 + 4 * 2_560 + 2 * 256
    embedding = 262_208 * 2_560
    total = 34 * layer + embedding + 2_560  # tied: the LM head is the embedding
    cost = model_cost_from_config(GEMMA_3_4B, None, "bfloat16")
    assert cost.parameter_count == total
    assert cost.kv_cache_bytes_per_token == 2 * 34 * 4 * 256 * 2
    # Tied: the embedding is a lookup going in and a matrix coming out, so 2 × every parameter per decode token.
    assert cost.flops_per_token() == 2 * total


def test_prefill_runs_the_lm_head_for_the_last_prompt_token_only() -> None:
    cost = model_cost_from_config(LLAMA_3_1_8B, None, "bfloat16")
    assert cost.parameter_count == LLAMA_8B_TOTAL == 8_030_261_248
    body = LLAMA_8B_TOTAL - 2 * LLAMA_8B_EMBEDDING  # the decoder layers and the final norm
    # 1,000 prompt tokens: 2 × body each, the LM head once, attention over 1,000²/2 pairs × 4 × 32 layers × 4,096.
    expected = 2 * body * 1_000 + 2 * LLAMA_8B_EMBEDDING + 4 * 32 * 4_096 * 1_000**2 / 2
    assert cost.prefill_flops(1_000) == pytest.approx(expected)
    # Decode runs it for every token.
    assert cost.decode_flops(1_000) == 1_000 * 2 * (body + LLAMA_8B_EMBEDDING)


def test_fp8_weights_are_one_byte_with_block_scales_and_the_kv_cache_stays_16_bit() -> None:
    # Block-wise FP8: the linear projections 1 byte each + one float32 scale per 128 × 128 block;
    # embeddings, LM head and norms stay bfloat16. FLOPs use the logical parameters.
    config = {
        **LLAMA_3_1_8B,
        "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    }
    cost = model_cost_from_config(config, None, "bfloat16")
    assert cost.parameter_count == LLAMA_8B_TOTAL
    expected = LLAMA_8B_LINEAR * (1 + 4 / 128**2) + (LLAMA_8B_TOTAL - LLAMA_8B_LINEAR) * 2
    assert cost.weight_bytes == round(expected) == 9_082_904_576
    # Judged against FP8 tensor peaks (`--dtype fp8`), the unquantised parts still stay in the checkpoint's bf16.
    assert model_cost_from_config(config, None, "fp8").weight_bytes == cost.weight_bytes
    assert cost.kv_cache_bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert cost.flops_per_token() == 2 * (LLAMA_8B_TOTAL - LLAMA_8B_EMBEDDING)


def test_awq_int4_weights_with_group_scales_and_zero_points() -> None:
    # 4 bits per weight + per group of 128 one fp16 scale (2 bytes) and one packed 4-bit zero point.
    config = {
        **LLAMA_3_1_8B,
        "torch_dtype": "float16",
        "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True},
    }
    cost = model_cost_from_config(config, None, "float16")
    per_weight = 0.5 + (2 + 0.5) / 128
    expected = LLAMA_8B_LINEAR * per_weight + (LLAMA_8B_TOTAL - LLAMA_8B_LINEAR) * 2
    assert cost.weight_bytes == round(expected) == 5_727_854_592  # 5.7 GB against 16.1 GB in float16


def test_a_quantised_checkpoint_s_stored_bytes_are_its_weight_bytes(tmp_path: Path) -> None:
    # Packed int4 (int32 words) and fp16 scales as stored: the header's offsets are the truth.
    config = {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_hidden_layers": 1,
        "vocab_size": 100,
        "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 32},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    header = {
        "qweight": {"dtype": "I32", "shape": [64, 8], "data_offsets": [0, 2048]},
        "scales": {"dtype": "F16", "shape": [2, 64], "data_offsets": [2048, 2304]},
        "embed": {"dtype": "F16", "shape": [100, 64], "data_offsets": [2304, 15104]},
    }
    encoded = json.dumps(header).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(encoded)) + encoded + bytes(15104))
    cost = model_cost_from_folder(tmp_path, "float16")
    assert cost.weight_bytes == 15104
    # The packed tensor's 512 int32 elements are not 512 parameters: the count comes from the config.
    assert cost.parameter_count == parameters_from_config(config).total


def test_kv_cache_dtype_is_taken_as_vllm_takes_it() -> None:
    cost = model_cost_from_config(LLAMA_3_1_8B, None, "bfloat16", kv_cache_dtype="fp8")
    assert cost.kv_cache_bytes_per_token == 2 * 32 * 8 * 128 * 1
    # 8-bit weights named by the served dtype keep a 16-bit cache unless told otherwise.
    assert model_cost_from_config(LLAMA_3_1_8B, None, "fp8").kv_cache_bytes_per_token == 2 * 32 * 8 * 128 * 2


def test_an_unsized_quantisation_is_refused_by_name() -> None:
    config = {**LLAMA_3_1_8B, "quantization_config": {"quant_method": "bitsandbytes"}}
    with pytest.raises(ValueError, match="unsupported quantization method 'bitsandbytes'"):
        model_cost_from_config(config, None, "bfloat16")


def test_a_moe_config_without_its_routing_names_what_it_lacks() -> None:
    config = {**MIXTRAL_8X7B}
    del config["num_experts_per_tok"]
    with pytest.raises(ValueError, match="lacks num_experts_per_tok"):
        parameters_from_config(config)
