"""Disaggregated prefill and decode in the calculator: how many GPUs of each pool a request rate needs.

One pool prefills prompts, the other decodes; each request's prompt KV cache crosses a link between
them. Prefill is judged one prompt at a time on the roofline (`roofline.prefill_time`), decode at the
batch the decode table calls best (the smallest batch of the largest tok/s: the compute-bound batch,
or the KV capacity's limit when that comes first), with every sequence holding the prompt and half
its output on average (continuous batching keeps sequences at every stage of their output).

An instance is the TP × PP devices one copy of the model runs on; both pools use the same instance.
Every link in `LINKS` is one GPU's port in one direction, and each GPU sends its own shard of the
KV cache over its own port (a DGX H100 has one 400 Gb/s NIC per GPU; vLLM's KV connectors move each
tensor-parallel rank's blocks to its peer rank): the transfer time is one GPU's bytes ÷ the port's
bandwidth. That is the wire floor: no protocol overhead, no setup, no overlap of the transfer with
the prefill's later layers (layer pipelining), no queueing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from phasescope.telemetry.hardware.peaks import HardwarePeaks
from phasescope.telemetry.model.capacity import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    Wall,
    binding_wall,
    capacity,
)
from phasescope.telemetry.model.cost import ModelCost
from phasescope.telemetry.model.roofline import compute_bound_batch_size, decode_step, prefill_time


@dataclass(frozen=True, slots=True)
class Link:
    """A link between the prefill and the decode pool, as one GPU's port sees it."""

    name: str
    bandwidth_bytes_per_second: float
    """One direction (the KV cache flows one way)."""
    source: str
    """Where the figure comes from."""


def _pcie_x16_bytes_per_second(gigatransfers_per_second: float) -> float:
    # 16 lanes × GT/s per lane × 128b/130b line coding (PCIe 3.0 and later) ÷ 8 bits per byte.
    return 16 * gigatransfers_per_second * 1e9 * 128 / 130 / 8


LINKS: dict[str, Link] = {
    # NVIDIA H100 Tensor Core GPU datasheet, SXM5: "NVLink: 900GB/s" (18 NVLink 4 links, both directions
    # together): 450 GB/s each way. Within an NVLink domain only (one HGX node without an NVLink Switch System).
    "nvlink4": Link("nvlink4", 450e9, "NVIDIA H100 datasheet: NVLink 4, 900 GB/s bidirectional"),
    # InfiniBand NDR (IBTA): 400 Gb/s per 4x port (NVIDIA ConnectX-7, one per GPU in a DGX H100) = 50 GB/s.
    "ib-ndr": Link("ib-ndr", 400e9 / 8, "InfiniBand NDR: 400 Gb/s per ConnectX-7 port"),
    # RDMA over 400 Gigabit Ethernet (IEEE 802.3bs/802.3ck 400GBASE): 400 Gb/s = 50 GB/s.
    "roce-400g": Link("roce-400g", 400e9 / 8, "IEEE 802.3 400GBASE Ethernet: 400 Gb/s"),
    # RDMA over 200 Gigabit Ethernet (IEEE 802.3bs 200GBASE): 200 Gb/s = 25 GB/s.
    "roce-200g": Link("roce-200g", 200e9 / 8, "IEEE 802.3 200GBASE Ethernet: 200 Gb/s"),
    # PCI-SIG PCIe 5.0: 32 GT/s per lane; x16 is 64 GB/s raw, 63.0 GB/s after 128b/130b coding.
    "pcie5-x16": Link("pcie5-x16", _pcie_x16_bytes_per_second(32), "PCIe 5.0: 32 GT/s × 16 lanes, 128b/130b"),
    # PCI-SIG PCIe 4.0: 16 GT/s per lane; x16 is 32 GB/s raw, 31.5 GB/s after 128b/130b coding.
    "pcie4-x16": Link("pcie4-x16", _pcie_x16_bytes_per_second(16), "PCIe 4.0: 16 GT/s × 16 lanes, 128b/130b"),
}
"""The links the calculator knows by name; `--link-bandwidth` gives any other."""
DEFAULT_LINK = "ib-ndr"
"""The fabric between the pools when none is named: 400 Gb/s InfiniBand, one port per GPU."""


def instances_needed(request_rate_per_second: float, requests_per_second_per_instance: float) -> int:
    """Instances whose summed capacity covers the request rate: ⌈rate ÷ capacity⌉."""
    # A rate that is an exact multiple of the capacity needs exactly that many instances; the quotient's
    # last-bit rounding (1.1 ÷ 0.1 = 11.000000000000002) must not add one.
    return math.ceil(request_rate_per_second / requests_per_second_per_instance * (1 - 1e-12))


def kv_transfer_seconds(cost: ModelCost, prompt_tokens: int, link: Link) -> float:
    """Seconds for one prompt's KV cache to cross `link`: each GPU's shard over its own port, all at once."""
    # Bytes per GPU = prompt tokens × KV bytes per token held on each device (2 × layers ÷ PP ×
    # kv_heads ÷ TP × head_dim × element bytes); time = bytes ÷ bandwidth: the wire floor.
    return prompt_tokens * cost.device_kv_cache_bytes_per_token / link.bandwidth_bytes_per_second


@dataclass(frozen=True, slots=True)
class Disaggregation:
    """The calculator's answer for a prefill pool and a decode pool serving one kind of request."""

    prompt_tokens: int
    output_tokens: int
    request_rate_per_second: float
    gpus_per_instance: int
    """TP × PP: the devices one copy of the model runs on, in either pool."""
    prefill_seconds: float
    """One prompt through every pipeline stage: the prefill's share of the time to first token."""
    prefill_bound: str
    """"compute" or "memory": the roof one prompt's prefill hits."""
    prefill_requests_per_second_per_instance: float
    """1 ÷ one prompt's prefill on each device (a full pipeline finishes one prompt per stage time)."""
    prefill_requests_per_second_per_gpu: float
    decode_context_length: int
    """Tokens each decoding sequence holds on average: prompt + output ÷ 2."""
    decode_batch_size: int
    """The smallest batch of the most decode tok/s: the compute-bound batch, or the KV capacity's limit."""
    decode_batch_limit: Wall
    """What sets that batch: "capacity" (the KV cache is full) or "compute" (the compute roof)."""
    decode_tokens_per_second_per_instance: float
    decode_requests_per_second_per_instance: float
    """Decode tok/s ÷ output tokens."""
    decode_requests_per_second_per_gpu: float
    prefill_to_decode_gpu_ratio: float
    """Prefill GPUs per decode GPU that balance the pools: decode capacity ÷ prefill capacity per GPU."""
    prefill_instances: int
    prefill_gpus: int
    decode_instances: int
    decode_gpus: int
    kv_bytes_per_token: int
    """The whole model's (every layer, every KV head)."""
    kv_bytes_per_request: int
    """Prompt tokens × KV bytes per token: what crosses from the prefill to the decode pool."""
    device_kv_bytes_per_request: float
    """Each GPU's shard of it, sent over that GPU's own port."""
    link: str
    link_bandwidth_bytes_per_second: float
    link_source: str
    kv_transfer_seconds: float
    """Each GPU's shard ÷ the link's bandwidth: the wire floor (no protocol overhead, no layer pipelining)."""
    ttft_bound: str
    """"prefill" or "transfer": the longer of the two parts of the time to first token."""
    ttft_floor_seconds: float
    """Prefill + transfer, nothing queued."""


def disaggregation(
    cost: ModelCost,
    peaks: HardwarePeaks,
    dtype: str,
    prompt_tokens: int,
    output_tokens: int,
    request_rate_per_second: float,
    link: Link,
    memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
) -> Disaggregation:
    """Prefill and decode capacity per instance and GPU, the pools a request rate needs, and the KV transfer.

    ValueError when there is nothing to size: no prompt or output, no request rate or link bandwidth, no
    KV bytes per token (a bare parameter count), no device memory, weights that do not fit, or a KV cache
    that holds no sequence at the decode context.
    """
    if prompt_tokens < 1 or output_tokens < 1:
        raise ValueError(f"prompt and output tokens must be at least 1, got {prompt_tokens} and {output_tokens}")
    if not (math.isfinite(request_rate_per_second) and request_rate_per_second > 0):
        raise ValueError(f"the request rate must be a positive number per second, got {request_rate_per_second}")
    if not (math.isfinite(link.bandwidth_bytes_per_second) and link.bandwidth_bytes_per_second > 0):
        raise ValueError(
            f"the link bandwidth must be a positive number of bytes/s, got {link.bandwidth_bytes_per_second}"
        )
    if cost.kv_cache_bytes_per_token <= 0:
        raise ValueError("the model has no KV bytes per token (a bare parameter count): nothing to transfer")
    if peaks.memory_bytes is None:
        raise ValueError(f"{peaks.device} has no memory figure: the decode batch cannot be sized")
    stage_seconds, prefill_bound = prefill_time(cost, peaks, dtype, prompt_tokens)
    # One prompt passes the PP stages one after another; a full pipeline finishes one per stage time.
    prefill_seconds = stage_seconds * cost.pipeline_parallel_size
    prefill_per_instance = 1.0 / stage_seconds

    # Sequences enter with the prompt's KV and leave at prompt + output tokens: on average half-way.
    context = prompt_tokens + output_tokens // 2
    cap = capacity(cost, peaks.memory_bytes, context, memory_utilization)
    if not cap.weights_fit:
        raise ValueError(f"the weights do not fit {peaks.device}: no decode batch runs")
    fit = cap.max_sequences_at_context
    if not fit:
        raise ValueError(f"the KV cache holds no sequence of {context:,} tokens (prompt + output ÷ 2)")
    compute_bound = compute_bound_batch_size(cost, peaks, dtype, context)
    limit = binding_wall(cap, compute_bound)
    # Past the compute-bound batch the tok/s are flat at the compute roof; the KV cache caps the batch anyway.
    batch = fit if limit == "capacity" or compute_bound is None else compute_bound
    decode_tokens_per_second = decode_step(cost, peaks, dtype, batch, context).decode_tokens_per_second_total
    decode_per_instance = decode_tokens_per_second / output_tokens

    devices = cost.devices
    prefill_instances = instances_needed(request_rate_per_second, prefill_per_instance)
    decode_instances = instances_needed(request_rate_per_second, decode_per_instance)
    transfer_seconds = kv_transfer_seconds(cost, prompt_tokens, link)
    return Disaggregation(
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        request_rate_per_second=request_rate_per_second,
        gpus_per_instance=devices,
        prefill_seconds=prefill_seconds,
        prefill_bound=prefill_bound,
        prefill_requests_per_second_per_instance=prefill_per_instance,
        prefill_requests_per_second_per_gpu=prefill_per_instance / devices,
        decode_context_length=context,
        decode_batch_size=batch,
        decode_batch_limit=limit,
        decode_tokens_per_second_per_instance=decode_tokens_per_second,
        decode_requests_per_second_per_instance=decode_per_instance,
        decode_requests_per_second_per_gpu=decode_per_instance / devices,
        # Each decode GPU takes the requests of this many prefill GPUs: decode capacity ÷ prefill capacity.
        prefill_to_decode_gpu_ratio=decode_per_instance / prefill_per_instance,
        prefill_instances=prefill_instances,
        prefill_gpus=prefill_instances * devices,
        decode_instances=decode_instances,
        decode_gpus=decode_instances * devices,
        kv_bytes_per_token=cost.kv_cache_bytes_per_token,
        kv_bytes_per_request=prompt_tokens * cost.kv_cache_bytes_per_token,
        device_kv_bytes_per_request=prompt_tokens * cost.device_kv_cache_bytes_per_token,
        link=link.name,
        link_bandwidth_bytes_per_second=link.bandwidth_bytes_per_second,
        link_source=link.source,
        kv_transfer_seconds=transfer_seconds,
        ttft_bound="transfer" if transfer_seconds > prefill_seconds else "prefill",
        ttft_floor_seconds=prefill_seconds + transfer_seconds,
    )
