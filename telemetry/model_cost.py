"""What one model costs to run: parameters, weight bytes, KV-cache bytes per token.

Computed from the checkpoint and its Hugging Face config, never guessed from
the model's name.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

_DTYPE_BYTES = {
    "float32": 4,
    "float": 4,
    "fp32": 4,
    "float16": 2,
    "half": 2,
    "fp16": 2,
    "bfloat16": 2,
    "bf16": 2,
    "float8": 1,
    "fp8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
}
_SAFETENSORS_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype name such as "bfloat16" or "torch.float16"."""
    name = dtype.removeprefix("torch.").lower()
    try:
        return _DTYPE_BYTES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(sorted(_DTYPE_BYTES))}") from None


def count_checkpoint_parameters(folder: Path) -> int | None:
    """Parameters stored in a folder's safetensors files (tied weights are stored, so counted, once).

    Reads only each file's JSON header. None when the folder has no safetensors files.
    """
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for path in files:
        with path.open("rb") as handle:
            (header_length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(header_length))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            count = 1
            for dimension in entry["shape"]:
                count *= int(dimension)
            total += count
    return total


@dataclass(frozen=True, slots=True)
class ModelCost:
    parameter_count: int
    bytes_per_parameter: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    kv_bytes_per_element: int
    attention_width: int = 0
    """Query heads × head dimension: the width attention computes over (differs from
    `hidden_size` in Gemma and some Qwen3 models); 0 falls back to `hidden_size`."""

    @property
    def weight_bytes(self) -> int:
        # Weight bytes = parameters x bytes per element of the served dtype.
        return self.parameter_count * self.bytes_per_parameter

    def flops_per_token(self, context_length: int = 0) -> float:
        # FLOPs per token ≈ 2 × parameters (one multiply and one add per weight)
        # + attention: 4 × layers × context × (query heads × head dim) for QKᵀ and AV over
        # the context; small at short context and 0 when the shape is unknown.
        width = self.attention_width or self.hidden_size
        return 2.0 * self.parameter_count + 4.0 * self.num_layers * context_length * width

    @property
    def kv_cache_bytes_per_token(self) -> int:
        # KV bytes per token = 2 (K and V) x layers x kv_heads x head_dim x bytes per element;
        # grouped-query attention is respected by using the KV heads, not the query heads.
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_bytes_per_element


def model_cost_from_numbers(parameter_count: int, dtype: str) -> ModelCost:
    """Cost of a model known only by its size: no KV-cache or attention terms."""
    return ModelCost(
        parameter_count=parameter_count,
        bytes_per_parameter=dtype_bytes(dtype),
        num_layers=0,
        num_kv_heads=0,
        head_dim=0,
        hidden_size=0,
        kv_bytes_per_element=dtype_bytes(dtype),
    )


def model_cost_from_folder(folder: Path, dtype: str | None = None, parameter_count: int | None = None) -> ModelCost:
    """Cost of a Hugging Face model folder (or a bare `config.json`); parameters counted from its checkpoint."""
    config_path = folder / "config.json" if folder.is_dir() else folder
    if not config_path.is_file():
        raise ValueError(f"no model config at {config_path} (give a Hugging Face model folder or its config.json)")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{config_path} is not JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{config_path} holds no JSON object")
    if parameter_count is None:
        parameter_count = count_checkpoint_parameters(config_path.parent)
    if parameter_count is None:
        raise ValueError(f"{config_path.parent} holds no safetensors checkpoint: give the parameter count")
    served = dtype or str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    return model_cost_from_config(config, parameter_count, served)


def model_cost_from_config(
    config: Mapping[str, object], parameter_count: int, dtype: str, kv_cache_dtype: str | None = None
) -> ModelCost:
    """Cost of a model described by a Hugging Face `config.json` (as a mapping).

    Multimodal and newer configs (Gemma 3, Llama 4, Mistral 3) nest the language model's
    shape under `text_config`: its fields win over the top level's.
    """
    nested = config.get("text_config")
    if isinstance(nested, Mapping):
        config = {**config, **nested}

    def integer(*names: str) -> int | None:
        for name in names:
            value = config.get(name)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        return None

    shape = {
        "num_hidden_layers": integer("num_hidden_layers", "n_layer", "num_layers"),
        "hidden_size": integer("hidden_size", "n_embd", "d_model"),
        "num_attention_heads": integer("num_attention_heads", "n_head"),
    }
    missing = [name for name, value in shape.items() if value is None]
    if missing:
        raise ValueError(f"the model config lacks {', '.join(missing)} (looked at the top level and text_config)")
    layers, hidden, heads = (value or 0 for value in shape.values())
    kv_heads = integer("num_key_value_heads", "num_kv_heads") or heads
    head_dim = integer("head_dim") or hidden // heads
    element = dtype_bytes(dtype)
    return ModelCost(
        parameter_count=parameter_count,
        bytes_per_parameter=element,
        num_layers=layers,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        hidden_size=hidden,
        kv_bytes_per_element=dtype_bytes(kv_cache_dtype) if kv_cache_dtype else element,
        attention_width=heads * head_dim,
    )
