"""LoRA adapters made on the spot for a base model, as PEFT writes them: no download.

Each is a folder with `adapter_config.json` and `adapter_model.safetensors`, A random (Kaiming-like scale) and
B random too, or zero: a zero-B adapter changes nothing, so it answers exactly as the base model does. The bench's
adapter mix and the tests make theirs here.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from phasescope.telemetry.model.adapter import CONFIG_FILE, WEIGHTS_FILE, projection_sizes
from phasescope.telemetry.model.cost import model_shape

DEFAULT_TARGETS = ("q_proj", "v_proj")


def write_safetensors(path: Path, tensors: Mapping[str, np.ndarray]) -> None:
    """float32 tensors in the safetensors layout (an 8-byte header length, the JSON header, the data)."""
    header: dict[str, object] = {}
    offset = 0
    blobs = []
    for name, array in tensors.items():
        data = np.ascontiguousarray(array, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(array.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with path.open("wb") as handle:
        handle.write(struct.pack("<Q", len(encoded)))
        handle.write(encoded)
        for blob in blobs:
            handle.write(blob)


def write_lora_adapter(
    folder: Path,
    base_config: Mapping[str, object],
    *,
    rank: int = 8,
    targets: Sequence[str] = DEFAULT_TARGETS,
    seed: int = 0,
    zero_b: bool = False,
    base_model: str = "",
) -> Path:
    """A rank-`rank` adapter of every layer's `targets` for the model of `base_config`, in `folder` (made)."""
    sizes = projection_sizes(base_config)
    layers = model_shape(base_config).layers
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}
    for layer in range(layers):
        for module in targets:
            in_features, out_features = sizes[module]
            part = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = rng.normal(0.0, 1.0 / np.sqrt(in_features), (rank, in_features))
            b = np.zeros((out_features, rank)) if zero_b else rng.normal(0.0, 0.5, (out_features, rank))
            tensors[f"{prefix}.lora_B.weight"] = b
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(targets),
        "bias": "none",
    }
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=1))
    write_safetensors(folder / WEIGHTS_FILE, tensors)
    return folder
