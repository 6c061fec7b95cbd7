"""A LoRA adapter read from its folder and checked against the base model it is to run on.

A PEFT adapter folder holds `adapter_config.json` (its rank `r`, `lora_alpha`, `target_modules`) and
`adapter_model.safetensors`: for each targeted projection of each layer a pair of matrices, A of shape
(r, in) and B of shape (out, r). Only the files' JSON headers are read, never the tensors.

The checks, each a one-line `AdapterError` naming what is wrong:
- the folder is an adapter (both files, a positive rank, known targets);
- its rank is at most the engine's `--max-lora-rank`;
- it fits the base model: every tensor names a layer the model has, and its shape is the (in, out) of that
  projection in the model's config. A mismatch means the adapter was trained on another base.

What it costs (the arithmetic `AdapterShape` gives, written once here):
- bytes: every A and B element at the stored element size (the files' own sizes), read once per step that runs
  a sequence with the adapter;
- FLOPs per token: 2 × r × (in + out) per adapted projection per layer (x·A, then (x·A)·B).
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from phasescope.telemetry.model.cost import model_shape

CONFIG_FILE = "adapter_config.json"
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ranks vLLM's LoRA kernels are built for (vllm.config.lora.MaxLoRARanks): --max-lora-rank takes these."""
WEIGHTS_FILE = "adapter_model.safetensors"
_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1}
# PEFT's tensor names: "base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight".
_TENSOR = re.compile(r"layers\.(\d+)\.(?:[\w.]+\.)?(\w+)\.lora_([AB])(?:\.[\w]+)?\.weight$")


class AdapterError(ValueError):
    """A folder that is not an adapter, or not one for this base model or engine (one line)."""


@dataclass(frozen=True, slots=True)
class AdapterShape:
    """One adapter as its files hold it."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    """The projections it adapts, sorted (e.g. ("q_proj", "v_proj"))."""
    layers: int
    """Layers it has matrices for."""
    dtype: str
    """The stored element type of its matrices (safetensors' name, e.g. "F32")."""
    bytes: int
    """Every A and B matrix's bytes as stored: what a step that runs it reads."""
    flops_per_token: float
    """2 × r × (in + out) summed over every adapted projection of every layer."""


def adapter_step_work(shape: AdapterShape, tokens: int, devices: int = 1) -> tuple[float, float]:
    """(FLOPs, bytes read) on each device of one adapter in one step that ran `tokens` tokens of its sequences: its
    A and B matrices once, its FLOPs per token for each token, sharded as the model is. The rule the step
    attribution and the calculator both follow."""
    return tokens * shape.flops_per_token / devices, shape.bytes / devices


class NamedAdapter(Protocol):
    """An adapter as the step telemetry reads it: its name and what it holds (the engine's `Adapter`)."""

    @property
    def name(self) -> str: ...

    @property
    def shape(self) -> AdapterShape: ...


def projection_sizes(config: Mapping[str, object]) -> dict[str, tuple[int, int]]:
    """The (in, out) features of each projection a LoRA may target, from the base model's config (Llama's names,
    which Mistral, Qwen and most decoders share)."""
    shape = model_shape(config)
    query, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    intermediate = shape.intermediate
    return {
        "q_proj": (shape.hidden, query),
        "k_proj": (shape.hidden, kv),
        "v_proj": (shape.hidden, kv),
        "o_proj": (query, shape.hidden),
        "gate_proj": (shape.hidden, intermediate),
        "up_proj": (shape.hidden, intermediate),
        "down_proj": (intermediate, shape.hidden),
    }


def _header(path: Path) -> dict[str, dict[str, object]]:
    try:
        with path.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
    except (OSError, struct.error, ValueError) as exc:
        raise AdapterError(f"{WEIGHTS_FILE} is not a safetensors file ({exc})") from exc
    return {name: entry for name, entry in header.items() if name != "__metadata__" and isinstance(entry, dict)}


def _config(folder: Path) -> dict[str, object]:
    if not folder.is_dir():
        raise AdapterError(f"{folder} is not a folder")
    missing = [name for name in (CONFIG_FILE, WEIGHTS_FILE) if not (folder / name).is_file()]
    if missing:
        raise AdapterError(f"{folder} is not a LoRA adapter: it has no {' and no '.join(missing)}")
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{CONFIG_FILE} is not JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise AdapterError(f"{CONFIG_FILE} is not a JSON object")
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"{CONFIG_FILE}: peft_type is {config.get('peft_type')!r}, not LORA")
    return config


def read_adapter(folder: Path, base_config: Mapping[str, object], max_rank: int) -> AdapterShape:
    """The adapter in `folder`, checked against the base model's config and the engine's largest rank."""
    config = _config(folder)
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"{CONFIG_FILE}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(f"rank {rank} is above the engine's --max-lora-rank {max_rank}")
    sizes = projection_sizes(base_config)
    layers = model_shape(base_config).layers
    seen_layers: set[int] = set()
    targets: set[str] = set()
    elements_bytes = 0
    dtypes: set[str] = set()
    flops = 0.0
    for name, entry in sorted(_header(folder / WEIGHTS_FILE).items()):
        match = _TENSOR.search(name)
        if match is None:
            raise AdapterError(f"{WEIGHTS_FILE}: {name} is not a LoRA matrix of a decoder layer")
        layer, module, side = int(match.group(1)), match.group(2), match.group(3)
        if module not in sizes:
            known = ", ".join(sizes)
            raise AdapterError(f"{WEIGHTS_FILE}: {name} adapts {module}, not a projection of this model ({known})")
        if layer >= layers:
            raise AdapterError(f"{WEIGHTS_FILE}: {name} is for layer {layer}; the model has {layers} (another base?)")
        dimensions = entry.get("shape")
        shape = [int(d) for d in dimensions] if isinstance(dimensions, list) else []
        in_features, out_features = sizes[module]
        expected = [rank, in_features] if side == "A" else [out_features, rank]
        if shape != expected:
            raise AdapterError(
                f"{WEIGHTS_FILE}: {name} is {shape}; on this base model it is {expected} (rank × inputs for A, "
                "outputs × rank for B): an adapter for another base model"
            )
        dtype = str(entry.get("dtype", ""))
        dtypes.add(dtype)
        offsets = entry.get("data_offsets")
        count = math.prod(shape)
        if isinstance(offsets, list) and len(offsets) == 2:
            elements_bytes += int(offsets[1]) - int(offsets[0])
        else:
            elements_bytes += count * _SAFETENSORS_BYTES.get(dtype, 0)
        if side == "A":
            flops += 2.0 * rank * (in_features + out_features)
        seen_layers.add(layer)
        targets.add(module)
    if not targets:
        raise AdapterError(f"{WEIGHTS_FILE} holds no LoRA matrices")
    alpha = config.get("lora_alpha", rank)
    return AdapterShape(
        rank=rank,
        alpha=float(alpha) if isinstance(alpha, int | float) else float(rank),
        targets=tuple(sorted(targets)),
        layers=len(seen_layers),
        dtype=",".join(sorted(dtypes)),
        bytes=elements_bytes,
        flops_per_token=flops,
    )
