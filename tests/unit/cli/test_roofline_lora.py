"""`phasescope roofline` with LoRA adapters: each distinct adapter's matrices once per step, its FLOPs per token."""

import json
from pathlib import Path

import pytest

from phasescope.bench.adapters import write_lora_adapter
from phasescope.cli.main import main
from phasescope.telemetry.hardware.peaks import lookup_device
from phasescope.telemetry.model.cost import model_cost_from_config
from phasescope.telemetry.model.lora import lora_rows, lora_shape
from support.model_configs import LLAMA_3_1_70B

# The default model's shape (SmolLM2-135M).
SMOL = {
    "model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9,
    "num_key_value_heads": 3, "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152,
    "tie_word_embeddings": True,
}  # fmt: skip


def test_an_adapters_shape_on_a_model_is_its_rank_times_the_projections_sizes() -> None:
    shape = lora_shape(SMOL, 16, ["q_proj", "v_proj"], "bf16")
    # 30 layers × 16 × ((576 + 576) + (576 + 192)) elements, 2 bytes each; 2 FLOPs an element per token.
    assert shape.bytes == 30 * 16 * 1920 * 2
    assert shape.flops_per_token == 2 * 30 * 16 * 1920
    with pytest.raises(ValueError, match="targets must be among q_proj"):
        lora_shape(SMOL, 16, ["embed_tokens"], "bf16")


def test_distinct_adapters_cost_their_matrices_once_each_and_a_batch_spreads_over_at_most_itself() -> None:
    config = {**LLAMA_3_1_70B}
    cost = model_cost_from_config(config, None, "bfloat16").sharded(4, 1)
    peaks = lookup_device("h100-sxm")
    assert peaks is not None
    shape = lora_shape(config, 16, ["q_proj", "k_proj", "v_proj", "o_proj"], "bf16")
    one = lora_rows(cost, peaks, "bf16", (1, 8, 64), 0, shape, 1)
    eight = lora_rows(cost, peaks, "bf16", (1, 8, 64), 0, shape, 8)
    # On each of 4 devices: a quarter of the matrices.
    assert eight.adapter_bytes == pytest.approx(shape.bytes / 4)
    assert [row.distinct_adapters for row in eight.rows] == [1, 8, 8]
    assert eight.rows[1].adapter_bytes_per_step == pytest.approx(8 * shape.bytes / 4)
    assert one.rows[1].adapter_bytes_per_step == pytest.approx(shape.bytes / 4)
    # Memory-bound decode: more distinct adapters, more bytes, fewer tokens/s; batch 1 is the same either way.
    assert eight.rows[1].decode_tokens_per_second_total < one.rows[1].decode_tokens_per_second_total
    assert eight.rows[0] == one.rows[0]
    assert all(row.throughput_ratio < 1 and row.bound == "memory" for row in eight.rows)


def test_the_cli_adds_the_adapter_table_and_json_and_refuses_what_it_cannot_cost(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(SMOL))
    argv = ["roofline", "--model", str(tmp_path), "--hardware", "h100-sxm", "--batch-sizes", "1,8"]
    assert main([*argv, "--lora-rank", "16", "--lora-adapters", "8"]) == 0
    out = capsys.readouterr().out
    assert "LoRA: 8 distinct adapters per batch, rank 16 of q_proj, v_proj: 1.84 MB of matrices each" in out
    assert main([*argv, "--lora-rank", "16", "--lora-adapters", "8", "--json"]) == 0
    lora = json.loads(capsys.readouterr().out)["lora"]
    assert [row["distinct_adapters"] for row in lora["rows"]] == [1, 8]
    # A real adapter folder: its rank, targets and stored (float32) bytes.
    folder = write_lora_adapter(tmp_path / "sql", SMOL, rank=8, targets=("q_proj",))
    assert main([*argv, "--lora-adapter", str(folder), "--json"]) == 0
    lora = json.loads(capsys.readouterr().out)["lora"]
    assert (lora["rank"], lora["targets"], lora["adapter_bytes"]) == (8, ["q_proj"], 30 * 8 * 1152 * 4)
    for extra, message in (
        (["--lora-rank", "16", "--lora-adapters", "0"], "--lora-adapters must be at least 1"),
        (["--lora-rank", "16", "--lora-targets", "lm_head"], "--lora-rank: targets must be among"),
        (["--lora-rank", "8", "--lora-adapter", str(folder)], "alternatives"),
        (["--lora-adapter", str(tmp_path)], "is not a LoRA adapter"),
    ):
        assert main([*argv, *extra]) == 2
        assert message in capsys.readouterr().err
    assert main(["roofline", "--params", "1e9", "--lora-rank", "16"]) == 2
    assert "--lora-rank needs --model" in capsys.readouterr().err
