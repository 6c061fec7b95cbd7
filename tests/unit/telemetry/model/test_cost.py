import json
import struct
from pathlib import Path

import pytest

from phasescope.telemetry.model.cost import count_checkpoint_parameters, dtype_bytes, model_cost_from_config

SMOLLM2_CONFIG = {
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "num_hidden_layers": 30,
    "head_dim": 64,
}


def test_kv_bytes_per_token_uses_kv_heads_for_grouped_query_attention() -> None:
    cost = model_cost_from_config(SMOLLM2_CONFIG, parameter_count=134_515_008, dtype="bfloat16")
    # 2 (K and V) x 30 layers x 3 KV heads x 64 dims x 2 bytes.
    assert cost.kv_cache_bytes_per_token == 2 * 30 * 3 * 64 * 2 == 23_040
    assert cost.weight_bytes == 134_515_008 * 2


def test_llama_70b_gqa_kv_bytes() -> None:
    config = {"hidden_size": 8192, "num_attention_heads": 64, "num_key_value_heads": 8, "num_hidden_layers": 80}
    cost = model_cost_from_config(config, parameter_count=70_000_000_000, dtype="bf16")
    assert cost.head_dim == 128
    assert cost.kv_cache_bytes_per_token == 327_680  # 320 KiB per token
    assert cost.weight_bytes == 140_000_000_000


def test_kv_cache_dtype_can_differ_from_weights() -> None:
    cost = model_cost_from_config(SMOLLM2_CONFIG, 1, dtype="bfloat16", kv_cache_dtype="fp8")
    assert cost.kv_cache_bytes_per_token == 2 * 30 * 3 * 64


def test_config_without_kv_heads_means_multi_head_attention() -> None:
    config = {"hidden_size": 768, "num_attention_heads": 12, "num_hidden_layers": 12}
    assert model_cost_from_config(config, 1, "float32").kv_cache_bytes_per_token == 2 * 12 * 12 * 64 * 4


def test_unknown_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown dtype"):
        dtype_bytes("float13")
    assert dtype_bytes("torch.float16") == 2


def write_safetensors_header(path: Path, shapes: dict[str, list[int]]) -> None:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        size = 2
        for dimension in shape:
            size *= dimension
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + b"\0" * offset)


def test_parameters_are_counted_from_the_checkpoint(tmp_path: Path) -> None:
    write_safetensors_header(tmp_path / "model-00001.safetensors", {"embed": [10, 4], "norm": [4]})
    write_safetensors_header(tmp_path / "model-00002.safetensors", {"proj": [4, 3]})
    assert count_checkpoint_parameters(tmp_path) == 40 + 4 + 12


def test_folder_without_checkpoint_counts_nothing(tmp_path: Path) -> None:
    assert count_checkpoint_parameters(tmp_path) is None


def test_nested_text_config_is_read_and_attention_uses_heads_times_head_dim() -> None:
    # Gemma 3 (4B) nests its language model under text_config, and its attention is
    # 8 heads × 256 = 2,048 wide while the hidden size is 2,560.
    config = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": {
            "hidden_size": 2560,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "num_hidden_layers": 34,
        },
        "vision_config": {"hidden_size": 1152, "num_hidden_layers": 27},
    }
    cost = model_cost_from_config(config, parameter_count=4_000_000_000, dtype="bf16")
    assert cost.num_layers == 34
    # KV per token = 2 × 34 layers × 4 KV heads × 256 × 2 bytes.
    assert cost.kv_cache_bytes_per_token == 2 * 34 * 4 * 256 * 2
    # Attention FLOPs at 1,000 tokens of context: 4 × 34 × 1,000 × 2,048 (not × 2,560).
    assert cost.flops_per_token(1000) - cost.flops_per_token(0) == 4 * 34 * 1000 * 2048


def test_a_config_without_its_shape_names_each_missing_field() -> None:
    with pytest.raises(ValueError, match="lacks num_hidden_layers, num_attention_heads"):
        model_cost_from_config({"hidden_size": 64}, 1, "bf16")
