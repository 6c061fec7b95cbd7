"""The figures of the last few seconds of engine steps, per engine and phase (pure).

`StepWindow` keeps each step with its attribution and turns the steps of the window into
tokens/s, bandwidth saturation, MFU, arithmetic intensity and busy time.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from phasescope.telemetry.step.attribution import StepCost
from phasescope.telemetry.step.records import PHASES, StepRecord

DEFAULT_WINDOW_SECONDS = 10.0
WAIT_REASONS = ("kv_cache", "slot", "adapters", "other")
"""Why a request waits (vLLM's "capacity" reason, split): `slot` — the running batch is at max_num_seqs;
`other` — the step used its whole token budget (max_num_batched_tokens); `kv_cache` — neither, so the
scheduler left it waiting because the blocks for its next chunk were not free (or the step preempted a
running request for blocks)."""


def wait_reason(running: int, max_running: int, scheduled_tokens: int, token_budget: int, preempted: bool) -> str:
    """Why the waiting requests of one scheduler sample wait (`WAIT_REASONS`), from the step that left them
    waiting: vLLM's scheduler admits waiting requests in order until a slot, the token budget or the KV
    cache runs out. Requests for a LoRA adapter the batch has no slot for are skipped, not stopped at: they
    are counted apart (`adapters`, `SchedulerState.waiting_for_adapters`), and this is the others' reason."""
    if preempted:
        return "kv_cache"
    if max_running and running >= max_running:
        return "slot"
    if token_budget and scheduled_tokens >= token_budget:
        return "other"
    return "kv_cache"


@dataclass(frozen=True, slots=True)
class PhaseFigures:
    """One phase of one engine over the window. Operating-point figures are None when no step carried the phase."""

    tokens_per_second: float
    """Tokens the phase produced per second (decode: emitted tokens; under speculative decoding the verified
    positions less the rejected drafts)."""
    memory_bandwidth_utilization: float | None
    """This phase's share of the device's bandwidth: its bytes moved ÷ window ÷ peak bytes/s."""
    compute_utilization: float | None
    """This phase's share of the device's compute: its FLOPs ÷ window ÷ peak FLOP/s."""
    arithmetic_intensity: float | None
    """FLOPs ÷ bytes moved by this phase: where it sits on the roofline."""
    batch_size: float | None
    """Mean requests per step that carried this phase."""
    busy_seconds: float
    memory_seconds: float = 0.0
    """Σ this phase's bytes moved ÷ peak bandwidth: the time its bytes need at the roof."""
    compute_seconds: float = 0.0
    """Σ this phase's FLOPs ÷ peak FLOP/s."""
    predicted_seconds: float = 0.0
    """Σ per step max(bytes time, FLOPs time): the roofline's time for the phase's work."""
    computed_tokens_per_second: float = 0.0
    """Positions computed per second: `tokens_per_second` plus, under speculative decoding, the rejected drafts."""


@dataclass(frozen=True, slots=True)
class DeviceFigures:
    """One engine's device over the window, all steps together."""

    memory_bandwidth_utilization: float
    compute_utilization: float
    arithmetic_intensity: float | None
    """None when no step ran in the window."""
    busy_ratio: float
    """Share of the window the engine spent executing steps."""

    @property
    def compute_idle(self) -> float:
        """Compute idleness = 1 − MFU of all steps."""
        return 1.0 - self.compute_utilization


SPECULATION_READINGS = ("paying", "acceptance", "compute")
"""Whether speculative decoding pays over the window (`SpeculationFigures.reading`)."""


@dataclass(frozen=True, slots=True)
class SpeculationFigures:
    """One engine's speculative decoding over the window: its verify steps' drafts and their cost (the part of
    each step inside the window; `attribution.SpeculativeCost`)."""

    drafts: float
    drafted_tokens: float
    accepted_tokens: float
    emitted_tokens: float = 0.0
    positions: float = 0.0
    """Decode positions the verify steps computed (each sequence's drafts and one of its own)."""
    sequence_steps: float = 0.0
    """Σ sequences per verify step: the tokens the same steps would have emitted without drafts."""
    useful_flops: float = 0.0
    wasted_flops: float = 0.0
    drafter_flops: float = 0.0
    drafter_seconds: float = 0.0
    busy_seconds: float = 0.0
    """Decode time of the verify steps (the drafter's included)."""
    verify_memory_seconds: float = 0.0
    verify_compute_seconds: float = 0.0
    speculative_seconds: float = 0.0
    plain_seconds: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted ÷ drafted tokens."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a sequence emits per verify step: its accepted drafts and one of its own (vLLM's definition)."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 0.0

    @property
    def useful_flops_share(self) -> float | None:
        """The emitted positions' FLOPs ÷ all decode FLOPs of the verify steps (the drafter's included)."""
        total = self.useful_flops + self.wasted_flops + self.drafter_flops
        return self.useful_flops / total if total else None

    @property
    def drafter_time_share(self) -> float | None:
        """The drafter's share of the verify steps' decode time."""
        return self.drafter_seconds / self.busy_seconds if self.busy_seconds else None

    @property
    def gain(self) -> float | None:
        """Emitted tokens per second of roofline time with speculation ÷ without it, for the same sequences at the
        same context: above 1 speculation pays on this device (host time left out)."""
        if not self.speculative_seconds or not self.plain_seconds or not self.sequence_steps:
            return None
        return (self.emitted_tokens / self.speculative_seconds) / (self.sequence_steps / self.plain_seconds)

    @property
    def reading(self) -> str | None:
        """`paying`; else why not: `compute` when the verify steps are compute-bound (their positions cost FLOP
        time, so drafts are no longer nearly free), `acceptance` when they are memory-bound (too few drafts are
        accepted for k, or the drafter costs too much). None without figures."""
        gain = self.gain
        if gain is None:
            return None
        if gain >= 1.0:
            return "paying"
        return "compute" if self.verify_compute_seconds >= self.verify_memory_seconds else "acceptance"


@dataclass(slots=True)
class _Windowed:
    end: float
    duration: float
    engine: int
    cost: StepCost
    step: StepRecord


def overlap_fraction(end: float, duration: float, window_start: float, window_end: float) -> float:
    """Share of a step lying inside the window: its work is spread evenly over its duration."""
    if duration <= 0.0:
        return 1.0 if window_start <= end <= window_end else 0.0
    start = end - duration
    inside = min(end, window_end) - max(start, window_start)
    return max(0.0, min(1.0, inside / duration))


class StepWindow:
    """The steps of the last `window_seconds`, per engine, and the figures they give.

    A step is recorded when it ends and covers the `elapsed_seconds` before;
    only the part of it that lies inside the window counts, so a long prefill
    step cannot push a window's utilisation above 1.
    """

    def __init__(
        self,
        engines: int,
        peak_bandwidth_bytes_per_second: float,
        peak_flops: float,
        window_seconds: float = DEFAULT_WINDOW_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engines = engines
        self.window_seconds = window_seconds
        self._bandwidth = peak_bandwidth_bytes_per_second
        self._flops = peak_flops
        self._clock = clock
        self._started = clock()
        self._lock = threading.Lock()
        self._recent: deque[_Windowed] = deque()
        # Scheduler samples (time, engine, running, waiting, why they wait, KV-cache usage), one per stats update.
        self._queue: deque[tuple[float, int, int, int, str, float, int]] = deque()
        self._scheduler: dict[int, tuple[int, int, float]] = {}
        self._reason: dict[int, str] = {}
        self._waiting_for_adapters: dict[int, int] = {}
        # Preemptions (time, engine, count), as the engine reports them.
        self._preemptions: deque[tuple[float, int, int]] = deque()

    def add(self, step: StepRecord, cost: StepCost, at: float | None = None) -> None:
        """A step that ended at `at` (None: now), on this window's clock."""
        now = self._clock() if at is None else at
        with self._lock:
            self._recent.append(_Windowed(now, step.elapsed_seconds, step.engine, cost, step))
            self._expire(now)

    def add_queue(
        self,
        engine: int,
        running: int,
        waiting: int,
        kv_cache_usage: float,
        reason: str = "other",
        at: float | None = None,
        waiting_for_adapters: int = 0,
    ) -> None:
        """The engine's scheduler state at a stats update (every step, and after aborts) made at `at` (None:
        now), and why its waiting requests wait (`wait_reason`; `waiting_for_adapters` of them for an adapter
        slot)."""
        now = self._clock() if at is None else at
        with self._lock:
            self._queue.append((now, engine, running, waiting, reason, kv_cache_usage, waiting_for_adapters))
            self._scheduler[engine] = (running, waiting, kv_cache_usage)
            self._reason[engine] = reason
            self._waiting_for_adapters[engine] = waiting_for_adapters
            self._expire(now)

    def add_preemptions(self, engine: int, count: int, at: float | None = None) -> None:
        """Requests the engine preempted for KV-cache blocks in one output batch (at `at`; None: now)."""
        now = self._clock() if at is None else at
        with self._lock:
            self._preemptions.append((now, engine, count))
            self._expire(now)

    def preemptions(self) -> dict[int, int]:
        """Per engine: requests preempted over the window."""
        with self._lock:
            self._expire(self._clock())
            counts = dict.fromkeys(range(self.engines), 0)
            for _, engine, count in self._preemptions:
                counts[engine] = counts.get(engine, 0) + count
            return counts

    def waiting_reason(self, engine: int) -> str:
        """Why the engine's waiting requests wait now (its latest sample's `wait_reason`), those waiting for an
        adapter slot apart (`waiting_for_adapters`)."""
        with self._lock:
            return self._reason.get(engine, "other")

    def waiting_for_adapters(self, engine: int) -> int:
        """The engine's waiting requests that wait for an adapter slot now (its latest sample's)."""
        with self._lock:
            return self._waiting_for_adapters.get(engine, 0)

    def _expire(self, now: float) -> None:
        horizon = now - self.window_seconds
        while self._recent and self._recent[0].end < horizon:
            self._recent.popleft()
        while self._queue and self._queue[0][0] < horizon:
            self._queue.popleft()
        while self._preemptions and self._preemptions[0][0] < horizon:
            self._preemptions.popleft()

    def wait_shares(self) -> dict[int, dict[str, float]]:
        """Per engine and `WAIT_REASONS` reason: the share of request time in the engine spent waiting for it,
        over the window (the reasons add up to the whole queue share).

        Each scheduler sample holds from the engine's previous sample to this one: waiting × that
        time is request-seconds queued, running × it request-seconds running.
        """
        now = self._clock()
        with self._lock:
            self._expire(now)
            samples = list(self._queue)
        waited = {engine: dict.fromkeys(WAIT_REASONS, 0.0) for engine in range(self.engines)}
        total = dict.fromkeys(range(self.engines), 0.0)
        previous: dict[int, float] = {}
        for at, engine, running, waiting, reason, _, for_adapters in samples:
            held = at - previous.get(engine, at)
            previous[engine] = at
            shares = waited.setdefault(engine, dict.fromkeys(WAIT_REASONS, 0.0))
            shares["adapters"] += held * for_adapters
            shares[reason] += held * (waiting - for_adapters)
            total[engine] = total.get(engine, 0.0) + held * (waiting + running)
        return {
            engine: {reason: value / total[engine] if total[engine] else 0.0 for reason, value in shares.items()}
            for engine, shares in waited.items()
        }

    def sequences_fit(self) -> dict[int, float | None]:
        """Per engine: how many sequences the KV cache holds at the window's mean context — the running
        sequence-seconds ÷ the cache-share-seconds they used (None when nothing ran in the window)."""
        now = self._clock()
        with self._lock:
            self._expire(now)
            samples = list(self._queue)
        sequence_seconds = dict.fromkeys(range(self.engines), 0.0)
        used = dict.fromkeys(range(self.engines), 0.0)
        previous: dict[int, float] = {}
        for at, engine, running, _, _, usage, _ in samples:
            held = at - previous.get(engine, at)
            previous[engine] = at
            sequence_seconds[engine] = sequence_seconds.get(engine, 0.0) + held * running
            used[engine] = used.get(engine, 0.0) + held * usage
        return {
            engine: sequence_seconds[engine] / used[engine] if used[engine] > 0 and sequence_seconds[engine] else None
            for engine in sequence_seconds
        }

    def schedulers(self) -> dict[int, tuple[int, int, float]]:
        """Per engine, its latest scheduler state: (running, waiting, KV-cache usage)."""
        with self._lock:
            return {engine: self._scheduler.get(engine, (0, 0, 0.0)) for engine in range(self.engines)}

    def _snapshot(self) -> tuple[list[tuple[float, _Windowed]], float]:
        """(fraction inside the window, entry) pairs, and the window's length."""
        now = self._clock()
        with self._lock:
            self._expire(now)
            recent = list(self._recent)
        # Before a whole window has passed, divide by the time actually observed.
        window = min(self.window_seconds, max(now - self._started, 1e-9))
        start = now - window
        return [(overlap_fraction(e.end, e.duration, start, now), e) for e in recent], window

    def length(self) -> float:
        """The window's length now: `window_seconds`, or the time observed so far when shorter."""
        return min(self.window_seconds, max(self._clock() - self._started, 1e-9))

    def figures(self) -> tuple[dict[tuple[int, str], PhaseFigures], dict[int, DeviceFigures]]:
        """Per (engine, phase) and per engine: the window's figures."""
        entries, window = self._snapshot()
        phases: dict[tuple[int, str], PhaseFigures] = {}
        devices: dict[int, DeviceFigures] = {}
        for engine in range(self.engines):
            mine = [(fraction, e) for fraction, e in entries if e.engine == engine and fraction > 0.0]
            for phase in PHASES:
                carried = [(fraction, e.cost.shares[phase]) for fraction, e in mine if e.cost.shares[phase].tokens]
                tokens = sum(fraction * share.emitted_tokens for fraction, share in carried)
                computed = sum(fraction * share.tokens for fraction, share in carried)
                flops = sum(fraction * share.flops for fraction, share in carried)
                moved = sum(fraction * share.moved_bytes for fraction, share in carried)
                weight = sum(fraction for fraction, _ in carried)
                # The roofline's time for the work charged to the phase, step by step.
                memory_times = [(fraction, share.moved_bytes / self._bandwidth) for fraction, share in carried]
                compute_times = [(fraction, share.flops / self._flops) for fraction, share in carried]
                phases[(engine, phase)] = PhaseFigures(
                    tokens_per_second=tokens / window,
                    # Bandwidth saturation = achieved bytes/s ÷ peak bytes/s (this phase's part).
                    memory_bandwidth_utilization=moved / window / self._bandwidth if carried else None,
                    # MFU = achieved FLOP/s ÷ peak FLOP/s (this phase's part).
                    compute_utilization=flops / window / self._flops if carried else None,
                    # Arithmetic intensity = FLOPs ÷ bytes moved.
                    arithmetic_intensity=flops / moved if carried and moved else None,
                    batch_size=(
                        sum(fraction * share.requests for fraction, share in carried) / weight if weight else None
                    ),
                    busy_seconds=sum(fraction * share.seconds for fraction, share in carried),
                    memory_seconds=sum(fraction * seconds for fraction, seconds in memory_times),
                    compute_seconds=sum(fraction * seconds for fraction, seconds in compute_times),
                    predicted_seconds=sum(
                        fraction * max(memory, compute)
                        for (fraction, memory), (_, compute) in zip(memory_times, compute_times, strict=True)
                    ),
                    computed_tokens_per_second=computed / window,
                )
            flops = sum(fraction * e.cost.flops for fraction, e in mine)
            moved = sum(fraction * (e.cost.read_bytes + e.cost.written_bytes) for fraction, e in mine)
            busy = sum(fraction * e.duration for fraction, e in mine)
            devices[engine] = DeviceFigures(
                memory_bandwidth_utilization=moved / window / self._bandwidth,
                compute_utilization=flops / window / self._flops,
                arithmetic_intensity=flops / moved if moved else None,
                busy_ratio=min(1.0, busy / window),
            )
        return phases, devices

    def speculation(self) -> dict[int, SpeculationFigures]:
        """Per engine that verified drafts in the window: its drafts and their cost (the part of each step inside
        the window)."""
        entries, _ = self._snapshot()
        totals: dict[int, dict[str, float]] = {}
        for fraction, entry in entries:
            speculative, cost = entry.step.speculative, entry.cost.speculative
            if speculative is None or fraction <= 0.0:
                continue
            figures: dict[str, float] = {
                "drafts": speculative.drafts,
                "drafted_tokens": speculative.drafted_tokens,
                "accepted_tokens": speculative.accepted_tokens,
            }
            if cost is not None:
                figures |= {
                    "emitted_tokens": cost.emitted_tokens,
                    "positions": cost.positions,
                    "sequence_steps": cost.requests,
                    "useful_flops": cost.useful_flops,
                    "wasted_flops": cost.wasted_flops,
                    "drafter_flops": cost.drafter_flops,
                    "drafter_seconds": cost.drafter_seconds,
                    "busy_seconds": entry.cost.shares["decode"].seconds,
                    "verify_memory_seconds": cost.verify_memory_seconds,
                    "verify_compute_seconds": cost.verify_compute_seconds,
                    "speculative_seconds": cost.speculative_seconds,
                    "plain_seconds": cost.plain_seconds,
                }
            sums = totals.setdefault(entry.engine, {})
            for name, value in figures.items():
                sums[name] = sums.get(name, 0.0) + fraction * value
        return {engine: SpeculationFigures(**sums) for engine, sums in totals.items()}

    def agreement(self) -> dict[str, float]:
        """Cost model ÷ engine estimate over the window, for FLOPs and bytes read (absent without engine estimates)."""
        with self._lock:
            self._expire(self._clock())
            recent = [e for e in self._recent if e.step.flops is not None]
        if not recent:
            return {}
        engine_flops = sum(e.step.flops or 0.0 for e in recent)
        engine_bytes = sum(e.step.read_bytes or 0.0 for e in recent)
        result: dict[str, float] = {}
        if engine_flops:
            result["flops"] = sum(e.cost.model_flops for e in recent) / engine_flops
        if engine_bytes:
            result["bytes"] = sum(e.cost.model_read_bytes for e in recent) / engine_bytes
        return result
