"""The third wall: whether a model fits a device, and how many tokens of KV cache are left beside it.

vLLM sizes its KV cache as what is left of `gpu_memory_utilization` × the device's memory once the
weights are loaded and a profiled forward pass has shown the activations' peak (plus the memory
outside PyTorch: the CUDA context, graphs, communication buffers). That budget, in blocks of
tokens, caps how many sequences run at once: as a batch grows, decode hits this wall or the
compute roof, whichever comes first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from phasescope.telemetry.model.cost import ModelCost

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
"""vLLM's `--gpu-memory-utilization` default: the share of the device's memory the engine may use."""
NON_TORCH_RESERVE_BYTES = 2 * 2**30
"""Memory outside the weights, the KV cache and the profiled activations on each device: the CUDA
context, the CUDA graphs vLLM captures at start-up and the communication buffers. vLLM measures it
at start-up; 2 GiB is a round figure of what it reports for a large model on a large GPU."""
PROFILE_TOKENS = 8192
"""Tokens in the forward pass vLLM profiles the activations with: its `max_num_batched_tokens` on a
large GPU (chunked prefill)."""
ACTIVATION_WIDTHS_PER_TOKEN = 12
"""Live activation elements per token at the peak of one layer, in units of the hidden size: the
residual and its normed copy (2), queries, keys and values (about 2), the attention output (1), and
the MLP's gate, up and activated projections (about 3 × 2.3, the intermediate size being ~3.5 × the
hidden size divided over the MLP's three tensors). Rounded to 12: an estimate, not a profile."""
FLAT_ACTIVATION_RESERVE_BYTES = 2**30
"""Without the model's shape (a bare parameter count), the activations' reserve is this flat figure."""
TENSOR_PARALLEL_SIZES = (1, 2, 4, 8, 16, 32, 64)
"""The tensor-parallel sizes searched for the smallest that fits (vLLM splits heads evenly: powers of two)."""

Wall = Literal["capacity", "compute"]


@dataclass(frozen=True, slots=True)
class Capacity:
    """Memory on each device of the deployment, and the KV cache that fits beside the weights."""

    device_memory_bytes: float
    memory_utilization: float
    usable_bytes: float
    """memory_utilization × device_memory_bytes: what the engine may use."""
    weight_bytes: float
    reserve_bytes: float
    """The activations' peak and the memory outside PyTorch (`activation_reserve`)."""
    weights_fit: bool
    """The weights and the reserve fit in the usable memory, with room for KV."""
    min_tensor_parallel_size: int | None
    """The smallest tensor-parallel size (at the same pipeline parallelism) whose weights fit; None
    when even the largest searched does not."""
    kv_capacity_bytes: float
    kv_capacity_tokens: int | None
    """Tokens of KV cache that fit; None when the model's KV bytes per token are unknown (a bare
    parameter count) or it fits no weights."""
    context_length: int
    max_sequences_at_context: int | None
    """Sequences of `context_length` tokens whose KV fits at once (each holds at least one token)."""


def activation_reserve(cost: ModelCost) -> float:
    """Bytes each device keeps free of weights and KV: the non-PyTorch memory and the activations of the
    profiled forward pass, PROFILE_TOKENS × ACTIVATION_WIDTHS_PER_TOKEN × hidden size × 2 bytes (16-bit
    activations; 4 when the model runs in float32), the MLP's and attention's part split by tensor
    parallelism — an estimate to be read within a gibibyte or so."""
    if not cost.hidden_size:
        return NON_TORCH_RESERVE_BYTES + FLAT_ACTIVATION_RESERVE_BYTES
    activation_bytes = 4 if cost.bytes_per_parameter >= 4 else 2
    # The residual stream (2 widths) is whole on every rank; the rest is split across the TP ranks.
    widths = 2 + (ACTIVATION_WIDTHS_PER_TOKEN - 2) / cost.tensor_parallel_size
    return NON_TORCH_RESERVE_BYTES + PROFILE_TOKENS * widths * cost.hidden_size * activation_bytes


def capacity(
    cost: ModelCost,
    device_memory_bytes: float,
    context_length: int,
    memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
) -> Capacity:
    """The deployment `cost` describes (already sharded over TP × PP) on devices of `device_memory_bytes`."""
    usable = memory_utilization * device_memory_bytes
    weights = cost.device_weight_bytes
    reserve = activation_reserve(cost)
    kv_bytes = usable - weights - reserve
    fits = kv_bytes > 0
    tokens: int | None = None
    sequences: int | None = None
    per_token = cost.device_kv_cache_bytes_per_token
    if fits and per_token > 0:
        tokens = int(kv_bytes // per_token)
        sequences = tokens // max(1, context_length)
    return Capacity(
        device_memory_bytes=device_memory_bytes,
        memory_utilization=memory_utilization,
        usable_bytes=usable,
        weight_bytes=weights,
        reserve_bytes=reserve,
        weights_fit=fits,
        min_tensor_parallel_size=min_tensor_parallel_size(cost, device_memory_bytes, memory_utilization),
        kv_capacity_bytes=max(0.0, kv_bytes),
        kv_capacity_tokens=tokens,
        context_length=context_length,
        max_sequences_at_context=sequences,
    )


def min_tensor_parallel_size(
    cost: ModelCost, device_memory_bytes: float, memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
) -> int | None:
    """The smallest TP (keeping the deployment's PP) at which each device holds its weights and reserve
    with room left for KV."""
    usable = memory_utilization * device_memory_bytes
    for size in TENSOR_PARALLEL_SIZES:
        sharded = cost.sharded(size, cost.pipeline_parallel_size)
        if usable - sharded.device_weight_bytes - activation_reserve(sharded) > 0:
            return size
    return None


def binding_wall(capacity: Capacity, compute_bound_batch_size: int | None) -> Wall:
    """Which wall a growing decode batch hits first: the KV cache full ("capacity") or the compute roof.

    Capacity binds when the weights do not fit (no batch runs at all), or when fewer sequences fit
    than the batch at which decode turns compute-bound (or decode never turns compute-bound); a model
    that fits but has no KV figure is only ever compute-bound here."""
    if not capacity.weights_fit:
        return "capacity"
    fit = capacity.max_sequences_at_context
    if fit is None:
        return "compute"
    if compute_bound_batch_size is None or fit < compute_bound_batch_size:
        return "capacity"
    return "compute"
