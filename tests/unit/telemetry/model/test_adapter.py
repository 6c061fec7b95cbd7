"""A LoRA adapter folder read against its base model: what it costs, and each way it is refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from phasescope.bench.adapters import write_lora_adapter, write_safetensors
from phasescope.telemetry.model.adapter import AdapterError, projection_sizes, read_adapter

# The default model's shape (SmolLM2-135M: Llama, 30 layers, 9 query and 3 KV heads of 64).
BASE = {
    "model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9,
    "num_key_value_heads": 3, "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152,
}  # fmt: skip


def test_a_rank_8_adapter_of_q_and_v_costs_its_matrices_bytes_and_two_flops_per_weight(tmp_path: Path) -> None:
    folder = write_lora_adapter(tmp_path / "a", BASE, rank=8, targets=("q_proj", "v_proj"))
    shape = read_adapter(folder, BASE, max_rank=16)
    # q_proj: A 8 × 576, B 576 × 8; v_proj: A 8 × 576, B 192 × 8; float32; 30 layers.
    per_layer = 8 * 576 + 576 * 8 + 8 * 576 + 192 * 8
    assert (shape.rank, shape.alpha, shape.targets, shape.layers, shape.dtype) == (
        8,
        16.0,
        ("q_proj", "v_proj"),
        30,
        "F32",
    )
    assert shape.bytes == 30 * per_layer * 4
    assert shape.flops_per_token == 2 * 30 * per_layer


def test_the_projections_sizes_follow_the_config() -> None:
    sizes = projection_sizes(BASE)
    assert sizes["q_proj"] == (576, 576)
    assert sizes["k_proj"] == sizes["v_proj"] == (576, 192)
    assert sizes["down_proj"] == (1536, 576)


def test_a_rank_above_the_engines_maximum_is_refused(tmp_path: Path) -> None:
    folder = write_lora_adapter(tmp_path / "a", BASE, rank=16)
    with pytest.raises(AdapterError, match="rank 16 is above the engine's --max-lora-rank 8"):
        read_adapter(folder, BASE, max_rank=8)


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda folder: None, "is not a folder"),
        (lambda folder: folder.mkdir(), "is not a LoRA adapter: it has no adapter_config.json and no adapter_model"),
        (lambda folder: (folder.mkdir(), (folder / "adapter_config.json").write_text("{}")), "it has no adapter_model"),
    ],
)
def test_a_folder_that_is_not_an_adapter_is_refused_saying_what_it_lacks(
    tmp_path: Path, setup: object, message: str
) -> None:
    folder = tmp_path / "nothing"
    setup(folder)  # type: ignore[operator]
    with pytest.raises(AdapterError, match=message):
        read_adapter(folder, BASE, max_rank=16)


def test_an_adapter_made_for_another_base_is_refused_naming_the_matrix_and_both_shapes(tmp_path: Path) -> None:
    other = {**BASE, "hidden_size": 1024, "num_attention_heads": 16, "head_dim": 64}
    folder = write_lora_adapter(tmp_path / "a", other, rank=8)
    with pytest.raises(AdapterError, match=r"layers\.0\.self_attn\.q_proj\.lora_A\.weight is \[8, 1024\]; on this base "
                       r"model it is \[8, 576\].*another base model"):  # fmt: skip
        read_adapter(folder, BASE, max_rank=16)


def test_an_adapter_with_more_layers_than_the_base_is_refused(tmp_path: Path) -> None:
    folder = write_lora_adapter(tmp_path / "a", {**BASE, "num_hidden_layers": 32}, rank=8)
    with pytest.raises(AdapterError, match="is for layer 30; the model has 30"):
        read_adapter(folder, BASE, max_rank=16)


def test_a_matrix_of_an_unknown_projection_is_refused(tmp_path: Path) -> None:
    folder = write_lora_adapter(tmp_path / "a", BASE, rank=8)
    write_safetensors(
        folder / "adapter_model.safetensors",
        {"base_model.model.model.layers.0.self_attn.rotary.lora_A.weight": np.zeros((8, 576))},
    )
    with pytest.raises(AdapterError, match="adapts rotary, not a projection of this model"):
        read_adapter(folder, BASE, max_rank=16)


def test_a_config_that_is_not_lora_is_refused(tmp_path: Path) -> None:
    folder = write_lora_adapter(tmp_path / "a", BASE, rank=8)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "peft_type": "PREFIX_TUNING"}))
    with pytest.raises(AdapterError, match="peft_type is 'PREFIX_TUNING', not LORA"):
        read_adapter(folder, BASE, max_rank=16)
