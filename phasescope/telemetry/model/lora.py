"""The roofline calculator with LoRA adapters: what n distinct adapters in a decode batch cost, and where it binds.

A batch of B sequences spread over n distinct adapters (n ≤ B; the engine runs at most `--max-loras` of them
a step) does the base model's decode step plus, for each distinct adapter, its A and B matrices read once
(`AdapterShape.bytes`) and, for each sequence, its adapter's FLOPs per token (2 × r × (inputs + outputs) of
every adapted projection). The matrices are small beside the weights, but they are read once per distinct
adapter, not once per batch: at large n and small B they take a visible share of the bandwidth a
bandwidth-bound decode lives on. The step's rules are the attribution's (`phasescope.telemetry.step.attribution.
adapter_work`), so what the calculator predicts is what the live series measure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from phasescope.telemetry.hardware.peaks import HardwarePeaks
from phasescope.telemetry.model.adapter import AdapterShape, adapter_step_work, projection_sizes
from phasescope.telemetry.model.cost import ModelCost, dtype_bytes, model_shape
from phasescope.telemetry.model.roofline import decode_step

DEFAULT_LORA_TARGETS = ("q_proj", "v_proj")


def lora_shape(config: Mapping[str, object], rank: int, targets: Sequence[str], dtype: str) -> AdapterShape:
    """The shape a rank-`rank` adapter of `targets` in every layer has on the model of `config`, stored in
    `dtype` (as a PEFT folder for that model would hold it); ValueError names an unknown target."""
    if rank < 1:
        raise ValueError(f"the rank must be at least 1, got {rank}")
    sizes = projection_sizes(config)
    unknown = [target for target in targets if target not in sizes]
    if unknown or not targets:
        raise ValueError(f"targets must be among {', '.join(sizes)}; got {', '.join(targets) or 'none'}")
    layers = model_shape(config).layers
    elements = layers * sum(rank * (sizes[target][0] + sizes[target][1]) for target in targets)
    return AdapterShape(
        rank=rank,
        alpha=float(rank),
        targets=tuple(sorted(set(targets))),
        layers=layers,
        dtype=dtype,
        bytes=elements * dtype_bytes(dtype),
        flops_per_token=2.0 * elements,
    )


@dataclass(frozen=True, slots=True)
class LoraRow:
    """One decode batch with adapters (per device)."""

    batch_size: int
    distinct_adapters: int
    """min(adapters, batch size): the adapters the batch's sequences spread over."""
    adapter_bytes_per_step: float
    adapter_flops_per_step: float
    step_seconds: float
    decode_tokens_per_second_total: float
    base_decode_tokens_per_second_total: float
    """The same batch on the base model alone."""
    adapter_share_of_bytes: float
    """The adapters' matrices' share of the step's bytes."""
    throughput_ratio: float
    """Tokens/s with the adapters ÷ without."""
    bound: str
    """"memory" or "compute": the roof the step hits with its adapters."""


@dataclass(frozen=True, slots=True)
class LoraReport:
    rank: int
    targets: tuple[str, ...]
    adapters: int
    adapter_bytes: float
    """One adapter's matrices on each device."""
    adapter_flops_per_token: float
    rows: tuple[LoraRow, ...]


def lora_rows(
    cost: ModelCost,
    peaks: HardwarePeaks,
    dtype: str,
    batch_sizes: Sequence[int],
    context_length: int,
    shape: AdapterShape,
    adapters: int,
) -> LoraReport:
    """Each batch's decode step with its sequences spread over `adapters` distinct adapters of `shape`."""
    if adapters < 1:
        raise ValueError(f"the adapters per batch must be at least 1, got {adapters}")
    devices = cost.devices
    per_token_flops, per_adapter_bytes = adapter_step_work(shape, 1, devices)
    bandwidth, peak_flops = peaks.memory_bandwidth_bytes_per_second, peaks.peak_flops(dtype)
    rows = []
    for batch in batch_sizes:
        base = decode_step(cost, peaks, dtype, batch, context_length)
        distinct = min(adapters, batch)
        # The batch's sequences over `distinct` adapters: their tokens' FLOPs, each adapter's matrices once.
        extra_flops = batch * per_token_flops
        extra_bytes = distinct * per_adapter_bytes
        step_bytes, step_flops = base.bytes_per_step + extra_bytes, base.flops_per_step + extra_flops
        memory_seconds, compute_seconds = step_bytes / bandwidth, step_flops / peak_flops
        seconds = max(memory_seconds, compute_seconds)
        rows.append(
            LoraRow(
                batch_size=batch,
                distinct_adapters=distinct,
                adapter_bytes_per_step=extra_bytes,
                adapter_flops_per_step=extra_flops,
                step_seconds=seconds,
                decode_tokens_per_second_total=batch / seconds,
                base_decode_tokens_per_second_total=base.decode_tokens_per_second_total,
                adapter_share_of_bytes=extra_bytes / step_bytes,
                throughput_ratio=base.step_seconds / seconds,
                bound="memory" if memory_seconds >= compute_seconds else "compute",
            )
        )
    return LoraReport(
        rank=shape.rank,
        targets=shape.targets,
        adapters=adapters,
        adapter_bytes=per_adapter_bytes,
        adapter_flops_per_token=per_token_flops,
        rows=tuple(rows),
    )
