"""From figures to answers: what bounds each phase, how much headroom an engine has, what a token costs.

Pure functions over one window's figures (`phasescope.telemetry.step.window.StepWindow`); Prometheus export
is in phasescope.telemetry.step.prometheus. The rules are written once, here, with their thresholds as
named constants; docs/metrics.md has a worked example of each verdict.

**The verdict of a phase** (per engine, over the window), the first that applies:
0. `capacity` (prefill and decode): the engine preempted a request for KV-cache blocks in the
   window, or requests spent at least `KV_WAIT_SHARE_FOR_VERDICT` of their time in the engine
   waiting for blocks while it had a free slot (`window.wait_reason`). The batch is held back
   by the memory, not by the slots or the roofs: new prompts wait for blocks (prefill), and the
   decode batch cannot grow (or loses sequences to recomputation).
1. `adapters` (prefill and decode): requests spent at least `ADAPTER_WAIT_SHARE_FOR_VERDICT` of
   their time in the engine waiting for a LoRA adapter slot: `max_loras` distinct adapters ran
   in the batch already and theirs was none of them, while the batch may have had room. The
   wall is the adapter slots (`--max-loras`), not the KV cache, the batch slots or the roofs.
2. `queue` (prefill only): requests spent at least `QUEUE_SHARE_FOR_VERDICT` of their time in
   the engine waiting (for a slot, or another reason than KV blocks) rather than running. What
   a new request's first token waits for is then the queue, whatever its prefill step does;
   decode is judged by its steps.
3. `idle`: the phase's steps took less than `IDLE_BUSY_SHARE` of the window — too little work
   to be bounded by anything.
4. `host`: the phase's steps ran below `ROOF_ATTAINMENT_FOR_BOUND` of the roofline's
   prediction for the work they did (predicted time = bytes ÷ peak bandwidth or FLOPs ÷ peak
   FLOP/s, the larger). The rest of the step time is not the hardware's limit: Python,
   scheduling, kernel launch and dispatch, or kernels far from their roof. The evidence is
   `phasescope_host_overhead_ratio` = 1 − predicted ÷ measured.
5. `memory` or `compute`: the steps ran within that margin of their roof; which one is the
   side of the ridge point they sit on (bytes time vs FLOPs time, summed over the window).

Why 0.7: a bandwidth-bound kernel that streams well reaches 70–90 % of the datasheet
bandwidth on current GPUs (the datasheet figure is a peak no kernel sustains), so a step at
70 % of its roof is as bandwidth-bound as hardware gets; at the ~52 % that batch-1 decode
reaches on the 2-core CPU of docs/roofline.md, a third of the step is something else, and
the verdict says `host`.

**Headroom** (per engine): how much more load the engine can take before the nearest of
four limits is hit, each `1 − used ÷ limit` clipped to [0, 1], the smallest winning:
- `bandwidth`: the device's bandwidth saturation (decode's resource) against `--headroom-bandwidth`;
- `compute`: the device's MFU (prefill's resource) against `--headroom-compute`;
- `kv_cache`: KV-cache usage against `--headroom-kv-cache`;
- `queue`: the share of request time spent waiting (for a slot, for KV blocks or for an adapter slot)
  against `--headroom-queue`: the adapter-slot wall takes headroom as it takes request time.
Load here is proportional: twice the traffic roughly doubles bandwidth, FLOPs and KV use, so
headroom 0.25 means about a third more load fits before the binding limit (1 ÷ 0.75).

**Cost** (with `--accelerator-cost-per-hour`): the engine's price for the window is
divided between the phases by their share of its busy time and spread over each phase's
tokens; the idle share of the price is the hour's price × compute idleness (1 − MFU): what
is paid for compute nobody used.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

VERDICTS = ("memory", "compute", "host", "queue", "idle", "capacity", "adapters")
HEADROOM_LIMITS = ("bandwidth", "compute", "kv_cache", "queue")

ROOF_ATTAINMENT_FOR_BOUND = 0.7
"""A phase whose steps reach at least this share of the roofline's predicted speed is
bounded by the roof it sits under; below it the verdict is `host`."""
IDLE_BUSY_SHARE = 0.01
"""A phase busy less than this share of the window is `idle`."""
QUEUE_SHARE_FOR_VERDICT = 0.5
"""Prefill is `queue`-bound when requests wait for a slot at least this share of their time in the engine."""
KV_WAIT_SHARE_FOR_VERDICT = 0.1
"""Both phases are `capacity`-bound when requests wait for KV-cache blocks, with a slot free, at least
this share of their time in the engine (or a request was preempted)."""
ADAPTER_WAIT_SHARE_FOR_VERDICT = 0.1
"""Both phases are `adapters`-bound when requests wait for a LoRA adapter slot at least this share of their time in
the engine."""


@dataclass(frozen=True, slots=True)
class PhaseWork:
    """What one phase's steps did over the window (the window's share of each step)."""

    busy_seconds: float
    """Measured step time charged to the phase."""
    memory_seconds: float
    """Σ bytes moved ÷ peak bandwidth: the time its bytes need at the roof."""
    compute_seconds: float
    """Σ FLOPs ÷ peak FLOP/s: the time its FLOPs need at the roof."""
    predicted_seconds: float
    """Σ per step max(memory, compute): the roofline's time for the work."""


@dataclass(frozen=True, slots=True)
class Verdict:
    verdict: str
    host_overhead: float | None
    """1 − predicted ÷ measured step time, in [0, 1]; None when the phase ran no step."""


def host_overhead(work: PhaseWork) -> float | None:
    """Share of the phase's step time the roofline does not explain; None without steps."""
    if work.busy_seconds <= 0.0:
        return None
    return min(1.0, max(0.0, 1.0 - work.predicted_seconds / work.busy_seconds))


def phase_verdict(
    phase: str,
    work: PhaseWork,
    window_seconds: float,
    queue_share: float,
    kv_wait_share: float = 0.0,
    preemptions: int = 0,
    adapter_wait_share: float = 0.0,
) -> Verdict:
    """The decision rule of the module docstring (`queue_share` is every reason's wait, KV's and the adapter
    slots' included)."""
    overhead = host_overhead(work)
    if preemptions > 0 or kv_wait_share >= KV_WAIT_SHARE_FOR_VERDICT:
        return Verdict("capacity", overhead)
    if adapter_wait_share >= ADAPTER_WAIT_SHARE_FOR_VERDICT:
        return Verdict("adapters", overhead)
    if phase == "prefill" and queue_share >= QUEUE_SHARE_FOR_VERDICT:
        return Verdict("queue", overhead)
    if overhead is None or work.busy_seconds < IDLE_BUSY_SHARE * window_seconds:
        return Verdict("idle", overhead)
    if 1.0 - overhead < ROOF_ATTAINMENT_FOR_BOUND:
        return Verdict("host", overhead)
    return Verdict("memory" if work.memory_seconds >= work.compute_seconds else "compute", overhead)


@dataclass(frozen=True, slots=True)
class HeadroomLimits:
    """What "full" means for each resource (flags `--headroom-*`); calibrate them from `phasescope bench`."""

    bandwidth: float = 0.8
    compute: float = 0.7
    kv_cache: float = 0.9
    queue: float = 0.1


@dataclass(frozen=True, slots=True)
class Headroom:
    ratio: float
    limit: str
    """The binding limit: one of HEADROOM_LIMITS."""
    each: Mapping[str, float]


def headroom(
    limits: HeadroomLimits,
    bandwidth_utilization: float,
    compute_utilization: float,
    kv_cache_usage: float,
    queue_share: float,
) -> Headroom:
    """The nearest limit's remaining share (module docstring)."""
    used = {
        "bandwidth": (bandwidth_utilization, limits.bandwidth),
        "compute": (compute_utilization, limits.compute),
        "kv_cache": (kv_cache_usage, limits.kv_cache),
        "queue": (queue_share, limits.queue),
    }
    each = {name: min(1.0, max(0.0, 1.0 - value / limit)) for name, (value, limit) in used.items()}
    binding = min(HEADROOM_LIMITS, key=lambda name: each[name])
    return Headroom(each[binding], binding, each)


@dataclass(frozen=True, slots=True)
class Cost:
    per_million_tokens: Mapping[str, float]
    """By phase; a phase without tokens in the window is absent."""
    idle_per_hour: float


def token_cost(
    cost_per_hour: float,
    window_seconds: float,
    busy_seconds: Mapping[str, float],
    tokens: Mapping[str, float],
    compute_idle: float,
) -> Cost:
    """Each phase's share of the window's price (by busy time) per million of its tokens, and the idle price."""
    price = cost_per_hour * window_seconds / 3600.0
    busy = sum(busy_seconds.values())
    per_million: dict[str, float] = {}
    if busy > 0.0:
        for phase, seconds in busy_seconds.items():
            count = tokens.get(phase, 0.0)
            if count > 0.0:
                per_million[phase] = price * (seconds / busy) / count * 1e6
    return Cost(per_million, cost_per_hour * min(1.0, max(0.0, compute_idle)))
