"""The roofline calculator: what a model's decode and prefill can reach on a device, and why.

Decode streams every weight (and each sequence's KV cache) from memory once
per step while doing ~2 FLOPs per weight per sequence, so it is bounded by
bandwidth until the batch is large enough for the FLOPs to catch up.
Speculative decoding (`speculation`) spends that idle compute on drafted tokens.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from phasescope.telemetry.hardware.peaks import HardwarePeaks
from phasescope.telemetry.model.capacity import DEFAULT_GPU_MEMORY_UTILIZATION, Capacity, Wall, binding_wall, capacity
from phasescope.telemetry.model.cost import ModelCost
from phasescope.telemetry.model.speculation import Speculation, speculation

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


@dataclass(frozen=True, slots=True)
class DecodeRow:
    batch_size: int
    bytes_per_step: float
    flops_per_step: float
    step_seconds: float
    decode_tokens_per_second_per_sequence: float
    decode_tokens_per_second_total: float
    achieved_flops_per_second: float
    memory_bandwidth_utilization: float
    compute_utilization: float
    compute_idle: float
    arithmetic_intensity_flops_per_byte: float
    bound: str
    """"memory" or "compute": which roof the step hits."""
    fits_in_kv_capacity: bool = True
    """The batch's KV cache at the context fits beside the weights (True when the capacity is unknown)."""


@dataclass(frozen=True, slots=True)
class RooflineReport:
    device: str
    peak_source: str
    dtype: str
    context_length: int
    parameter_count: int
    """Whole model, every expert."""
    active_parameter_count: int
    """Parameters one token goes through (all of them for a dense model)."""
    tensor_parallel_size: int
    pipeline_parallel_size: int
    weight_bytes: float
    """On each device, like every figure below: the model divided between TP × PP devices."""
    kv_bytes_per_token: float
    flops_per_token: float
    peak_memory_bandwidth_bytes_per_second: float
    peak_flops: float
    ridge_point_flops_per_byte: float
    compute_bound_batch_size: int | None
    prefill_tokens: int
    prefill_seconds: float
    prefill_bound: str
    rows: tuple[DecodeRow, ...]
    """Empty when the weights do not fit: no batch can run."""
    capacity: Capacity | None = None
    """Memory on each device and the KV cache beside the weights; None when the device's memory is unknown."""
    capacity_row: DecodeRow | None = None
    """The decode step of the largest batch whose KV cache fits at the context (the capacity wall)."""
    speculation: Speculation | None = None
    """Speculative decoding at k drafted tokens and an acceptance rate; None when not asked for."""

    @property
    def binding_wall(self) -> Wall | None:
        """The wall a growing batch hits first (None when the capacity is unknown)."""
        if self.capacity is None:
            return None
        return binding_wall(self.capacity, self.compute_bound_batch_size)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["rows"] = [asdict(row) for row in self.rows]
        cap = self.capacity
        data.pop("capacity")
        data.pop("speculation")
        data["capacity_row"] = asdict(self.capacity_row) if self.capacity_row is not None else None
        data.update(
            device_memory_bytes=cap.device_memory_bytes if cap else None,
            gpu_memory_utilization=cap.memory_utilization if cap else None,
            weights_fit=cap.weights_fit if cap else None,
            min_tensor_parallel_size=cap.min_tensor_parallel_size if cap else None,
            activation_reserve_bytes=cap.reserve_bytes if cap else None,
            kv_capacity_bytes=cap.kv_capacity_bytes if cap else None,
            kv_capacity_tokens=cap.kv_capacity_tokens if cap else None,
            max_sequences_at_context=cap.max_sequences_at_context if cap else None,
            binding_wall=self.binding_wall,
        )
        spec = self.speculation
        if spec is not None:
            # Top level: k, a, E, the best k and where speculation stops helping; each row: its verify step.
            data.update({key: value for key, value in asdict(spec).items() if key != "rows"})
            for row, spec_row in zip(data["rows"], spec.rows, strict=True):
                row.update({key: value for key, value in asdict(spec_row).items() if key != "batch_size"})
        return data

    def cost_per_million_tokens(self, cost_per_hour: float) -> list[float]:
        """Per decode row: what a million output tokens cost at `cost_per_hour` per device.

        The deployment's price (per device × TP × PP) for an hour ÷ the tokens it decodes in
        that hour at the row's rate, × one million.
        """
        devices = self.tensor_parallel_size * self.pipeline_parallel_size
        return [cost_per_hour * devices / (row.decode_tokens_per_second_total * 3600.0) * 1e6 for row in self.rows]


def decode_step(cost: ModelCost, peaks: HardwarePeaks, dtype: str, batch_size: int, context_length: int) -> DecodeRow:
    bandwidth = peaks.memory_bandwidth_bytes_per_second
    peak_flops = peaks.peak_flops(dtype)
    # Bytes moved per decode step on each device ≈ the weights the batch reads (all of them,
    # or for a mixture of experts the experts its tokens touch) + Σ over running sequences of
    # (context length × KV bytes per token): weights are read once for the whole batch.
    bytes_per_step = cost.weights_read(batch_size) + batch_size * context_length * cost.device_kv_cache_bytes_per_token
    # FLOPs per step = batch × FLOPs per token (2 × active parameters + attention at this context).
    flops_per_step = cost.decode_flops(batch_size, batch_size * context_length)
    # The step lasts as long as its slower resource needs: streaming the bytes or doing the FLOPs.
    memory_seconds = bytes_per_step / bandwidth
    compute_seconds = flops_per_step / peak_flops
    step_seconds = max(memory_seconds, compute_seconds)
    achieved_flops = flops_per_step / step_seconds
    # Model FLOPs utilisation = achieved FLOP/s ÷ peak FLOP/s; compute idleness = 1 − MFU.
    compute_utilization = achieved_flops / peak_flops
    return DecodeRow(
        batch_size=batch_size,
        bytes_per_step=bytes_per_step,
        flops_per_step=flops_per_step,
        step_seconds=step_seconds,
        decode_tokens_per_second_per_sequence=1.0 / step_seconds,
        decode_tokens_per_second_total=batch_size / step_seconds,
        achieved_flops_per_second=achieved_flops,
        # Bandwidth saturation = achieved bytes/s ÷ peak bytes/s.
        memory_bandwidth_utilization=bytes_per_step / step_seconds / bandwidth,
        compute_utilization=compute_utilization,
        compute_idle=1.0 - compute_utilization,
        arithmetic_intensity_flops_per_byte=flops_per_step / bytes_per_step,
        bound="memory" if memory_seconds >= compute_seconds else "compute",
    )


def compute_bound_batch_size(cost: ModelCost, peaks: HardwarePeaks, dtype: str, context_length: int) -> int | None:
    """Smallest batch whose decode step is compute-bound; None if KV traffic keeps it memory-bound forever.

    B × F ÷ peak FLOP/s ≥ (W(B) + B × c × kv) ÷ peak bytes/s, where W(B) is the weights a batch
    of B reads (constant for a dense model, growing towards all experts for a mixture of
    experts). Both sides grow with B and the FLOPs side fastest, so the first B is found by
    doubling, then bisection; beyond 2²⁰ sequences the answer is "never".
    """

    def compute_bound(batch: int) -> bool:
        return decode_step(cost, peaks, dtype, batch, context_length).bound == "compute"

    high = 1
    while not compute_bound(high):
        high *= 2
        if high > 2**20:
            return None
    low = high // 2
    while high - low > 1:
        middle = (low + high) // 2
        if compute_bound(middle):
            high = middle
        else:
            low = middle
    return high


def prefill_time(cost: ModelCost, peaks: HardwarePeaks, dtype: str, prompt_tokens: int) -> tuple[float, str]:
    """Seconds to prefill one prompt on each device, and the roof it hits."""
    # 2 × active parameters per token, the LM head once, and attention: token i attends to
    # i earlier tokens, Σ 4 × layers × i × width ≈ 2 × layers × width × n².
    flops = cost.prefill_flops(prompt_tokens)
    # The weights its tokens touch are read once; the prompt's KV cache is written once.
    moved = cost.weights_read(prompt_tokens) + prompt_tokens * cost.device_kv_cache_bytes_per_token
    memory_seconds = moved / peaks.memory_bandwidth_bytes_per_second
    compute_seconds = flops / peaks.peak_flops(dtype)
    return max(memory_seconds, compute_seconds), ("compute" if compute_seconds > memory_seconds else "memory")


def roofline(
    cost: ModelCost,
    peaks: HardwarePeaks,
    dtype: str,
    *,
    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES,
    context_length: int = 0,
    prefill_tokens: int = 1024,
    memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    speculative_tokens: int | None = None,
    acceptance_rate: float | None = None,
) -> RooflineReport:
    """`peaks.memory_bytes`, when known, adds the capacity wall: whether the weights fit, the KV cache
    beside them within `memory_utilization` of the memory, and which rows' batches fit in it.

    `speculative_tokens` and `acceptance_rate`, given together, add speculative decoding's figures
    beside each row (`speculation`)."""
    if (speculative_tokens is None) != (acceptance_rate is None):
        raise ValueError("speculative_tokens and acceptance_rate go together: give both or neither")
    prefill_seconds, prefill_bound = prefill_time(cost, peaks, dtype, prefill_tokens)
    cap = capacity(cost, peaks.memory_bytes, context_length, memory_utilization) if peaks.memory_bytes else None
    rows = tuple(decode_step(cost, peaks, dtype, batch, context_length) for batch in batch_sizes)
    if cap is not None:
        fit = cap.max_sequences_at_context
        rows = tuple(replace(row, fits_in_kv_capacity=fit is None or row.batch_size <= fit) for row in rows)
        if not cap.weights_fit:
            rows = ()
    spec = None
    if speculative_tokens is not None and acceptance_rate is not None:
        batches = tuple(row.batch_size for row in rows)
        spec = speculation(cost, peaks, dtype, batches, context_length, speculative_tokens, acceptance_rate)
    wall = None
    if cap is not None and cap.max_sequences_at_context:
        wall = decode_step(cost, peaks, dtype, cap.max_sequences_at_context, context_length)
    return RooflineReport(
        device=peaks.device,
        peak_source=peaks.source,
        dtype=dtype,
        context_length=context_length,
        parameter_count=cost.parameter_count,
        active_parameter_count=cost.active_parameter_count,
        tensor_parallel_size=cost.tensor_parallel_size,
        pipeline_parallel_size=cost.pipeline_parallel_size,
        weight_bytes=cost.device_weight_bytes,
        kv_bytes_per_token=cost.device_kv_cache_bytes_per_token,
        flops_per_token=cost.flops_per_token(context_length),
        peak_memory_bandwidth_bytes_per_second=peaks.memory_bandwidth_bytes_per_second,
        peak_flops=peaks.peak_flops(dtype),
        ridge_point_flops_per_byte=peaks.ridge_point_flops_per_byte(dtype),
        compute_bound_batch_size=compute_bound_batch_size(cost, peaks, dtype, context_length),
        prefill_tokens=prefill_tokens,
        prefill_seconds=prefill_seconds,
        prefill_bound=prefill_bound,
        rows=rows,
        capacity=cap,
        capacity_row=wall,
        speculation=spec,
    )
