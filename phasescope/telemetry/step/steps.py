"""What each engine step did, and the figures over a window of steps (pure: no Prometheus here).

The engine reports every step (phasescope.engine.vllm.stats turns vLLM's SchedulerStats
into a `StepRecord`). Each step is classified (prefill-only, decode-only or
mixed), its work is attributed to the phases (`attribute_step`), and
`StepWindow` turns the steps of the last few seconds into utilisations.
phasescope.telemetry.step.prometheus exports them.

**The phase split (written once, here and in docs/metrics.md).** A pure step
belongs wholly to its phase. In a mixed step (chunked prefill: new prompts'
chunks scheduled beside running decodes) each phase is charged its marginal
cost, so that neither phase's operating point is contaminated by the other's:
- FLOPs are split in the cost model's proportion: ≈ 2 × active parameters
  per token in either phase, but the LM head runs once per prefill request
  and attention depends on each phase's context.
- Bytes read: decode pays what a decode-only step of its batch would read by
  the cost model — the weights its tokens touch once (all of them for a dense
  model), plus its sequences' KV cache (estimated
  as the cache in use less the chunk's tokens), at most the step's total; the
  prefill chunk pays the rest, everything it adds (its KV, its activations).
- Bytes written: decode pays its new tokens' KV entries; the chunk the rest.
- Time is split in proportion to each phase's roofline time for the work it
  was charged (max of bytes ÷ peak bandwidth and FLOPs ÷ peak FLOP/s).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from phasescope.telemetry.model.cost import ModelCost

PHASES = ("prefill", "decode")
STEP_KINDS = ("prefill", "decode", "mixed")
DEFAULT_WINDOW_SECONDS = 10.0


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One engine step, as the engine core accounted it."""

    engine: int
    prefill_requests: int
    prefill_tokens: int
    """Prompt tokens computed, chunks and recomputation after preemption included."""
    decode_requests: int
    decode_tokens: int
    """New output tokens computed (one per decoding sequence, more with speculative decoding)."""
    elapsed_seconds: float
    """The step's execution time, measured in the engine core."""
    flops: float | None = None
    """The engine's own estimate for the step (vLLM --enable-mfu-metrics), per device."""
    read_bytes: float | None = None
    written_bytes: float | None = None
    kv_cache_tokens: int = 0
    """Tokens held in the KV cache at this step (read once by a decode step)."""

    @property
    def kind(self) -> str:
        """ "prefill" or "decode" when the step carried one phase only, else "mixed"."""
        if not self.decode_tokens:
            return "prefill"
        if not self.prefill_tokens:
            return "decode"
        return "mixed"


@dataclass(frozen=True, slots=True)
class EngineIteration:
    """Per-output-batch facts the engine's front end computed (vLLM's IterationStats)."""

    engine: int
    inter_token_seconds: Sequence[float]
    """Every gap between a request's consecutive output tokens in this batch, on the engine core's clock."""
    preemptions: int


class StepForwarder:
    """Where the engine's reports go; reports seen before a sink is attached are dropped.

    The engine needs its stat logger before it starts, the sink needs the
    engine's dtype and device, which are known only after: this sits between.
    Nothing raised by a sink reaches the engine (vLLM would fail every request
    in flight): it goes to `on_error`.
    """

    def __init__(self, on_error: Callable[[str, BaseException], None] = lambda component, exc: None) -> None:
        self.sink: Callable[[StepRecord], None] | None = None
        self.iteration_sink: Callable[[EngineIteration], None] | None = None
        self.queue_sink: Callable[[int, int, int, float], None] | None = None
        self.on_error = on_error
        self.interference = InterferenceLedger()
        """Advanced by the sink (StepMetrics) with each step; read by the engine for its requests."""

    def failed(self, exc: BaseException) -> None:
        self.on_error("step", exc)

    def _deliver(self, sink: Callable[..., None] | None, *report: object) -> None:
        if sink is None:
            return
        try:
            sink(*report)
        except Exception as exc:
            self.failed(exc)

    def __call__(self, step: StepRecord) -> None:
        self._deliver(self.sink, step)

    def iteration(self, iteration: EngineIteration) -> None:
        self._deliver(self.iteration_sink, iteration)

    def queue(self, engine: int, running: int, waiting: int, kv_cache_usage: float) -> None:
        """The engine's scheduler state, reported with every stats update (also after aborts)."""
        self._deliver(self.queue_sink, engine, running, waiting, kv_cache_usage)


@dataclass(frozen=True, slots=True)
class PhaseShare:
    """The part of one step charged to one phase."""

    tokens: int
    requests: int
    seconds: float
    flops: float
    read_bytes: float
    written_bytes: float

    @property
    def moved_bytes(self) -> float:
        return self.read_bytes + self.written_bytes


@dataclass(frozen=True, slots=True)
class StepCost:
    """A step's totals and their attribution to the phases."""

    flops: float
    read_bytes: float
    written_bytes: float
    model_flops: float
    """The project's cost model's FLOPs for the step (the cross-check of the engine's estimate)."""
    model_read_bytes: float
    shares: dict[str, PhaseShare]


def decode_context_tokens(step: StepRecord) -> int:
    """Tokens in the KV cache of the step's decoding sequences: the cache in use less the chunks' tokens."""
    return max(0, step.kv_cache_tokens - step.prefill_tokens)


def model_step_cost(cost: ModelCost, step: StepRecord) -> tuple[float, float, float]:
    """(FLOPs, bytes read, bytes written) on each device of a step, by the project's own cost model."""
    tokens = step.prefill_tokens + step.decode_tokens
    # FLOPs: the prefill chunks (LM head once per request, attention within the chunk) and the
    # decode tokens (LM head each, attention over their sequences' context).
    flops = cost.prefill_flops(step.prefill_tokens, step.prefill_requests) + cost.decode_flops(
        step.decode_tokens, decode_context_tokens(step)
    )
    # Bytes read ≈ the weights the step's tokens touch (once per step) + the KV cache of the running sequences.
    read_bytes = cost.weights_read(tokens) + step.kv_cache_tokens * cost.device_kv_cache_bytes_per_token
    # Bytes written ≈ each computed token's new KV entries.
    written_bytes = tokens * cost.device_kv_cache_bytes_per_token
    return flops, read_bytes, written_bytes


def attribute_step(
    step: StepRecord, cost: ModelCost, peak_bandwidth_bytes_per_second: float, peak_flops: float
) -> StepCost:
    """Totals of a step (the engine's estimate when it gives one) and each phase's charge (module docstring)."""
    model_flops, model_read, model_written = model_step_cost(cost, step)
    flops = step.flops if step.flops is not None else model_flops
    read_bytes = step.read_bytes if step.read_bytes is not None else model_read
    written_bytes = step.written_bytes if step.written_bytes is not None else model_written
    total_tokens = step.prefill_tokens + step.decode_tokens
    kind = step.kind
    if kind == "mixed":
        token_share = step.decode_tokens / total_tokens
        # Decode pays what a decode-only step of its batch would move: the weights once and
        # its own sequences' KV (by the cost model, at most the step's total); the chunk pays
        # the rest, everything it adds (its KV, its activations).
        kv_bytes = cost.device_kv_cache_bytes_per_token
        decode_alone_read = cost.weights_read(step.decode_tokens) + decode_context_tokens(step) * kv_bytes
        decode_read_bytes = min(read_bytes, decode_alone_read)
        decode_written = min(written_bytes, step.decode_tokens * kv_bytes)
        # FLOPs are split in the cost model's proportion (its decode FLOPs ÷ its step FLOPs).
        model_decode_flops = cost.decode_flops(step.decode_tokens, decode_context_tokens(step))
        decode_flops = flops * (model_decode_flops / model_flops if model_flops > 0 else token_share)
        prefill_flops, prefill_read_bytes = flops - decode_flops, read_bytes - decode_read_bytes
        prefill_written = written_bytes - decode_written

        def roofline_seconds(phase_flops: float, moved: float) -> float:
            return max(moved / peak_bandwidth_bytes_per_second, phase_flops / peak_flops)

        decode_time = roofline_seconds(decode_flops, decode_read_bytes + decode_written)
        prefill_time = roofline_seconds(prefill_flops, prefill_read_bytes + prefill_written)
        time_share = decode_time / (decode_time + prefill_time) if decode_time + prefill_time else token_share
        decode_seconds = step.elapsed_seconds * time_share
        shares = {
            "prefill": PhaseShare(
                step.prefill_tokens,
                step.prefill_requests,
                step.elapsed_seconds - decode_seconds,
                prefill_flops,
                prefill_read_bytes,
                prefill_written,
            ),
            "decode": PhaseShare(
                step.decode_tokens,
                step.decode_requests,
                decode_seconds,
                decode_flops,
                decode_read_bytes,
                decode_written,
            ),
        }
    else:
        empty = PhaseShare(0, 0, 0.0, 0.0, 0.0, 0.0)
        whole = PhaseShare(
            total_tokens,
            step.prefill_requests + step.decode_requests,
            step.elapsed_seconds,
            flops,
            read_bytes,
            written_bytes,
        )
        shares = {phase: whole if phase == kind else empty for phase in PHASES}
    return StepCost(flops, read_bytes, written_bytes, model_flops, model_read, shares)


@dataclass(frozen=True, slots=True)
class PhaseFigures:
    """One phase of one engine over the window. Operating-point figures are None when no step carried the phase."""

    tokens_per_second: float
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
        # Scheduler samples (time, engine, running, waiting), one per stats update.
        self._queue: deque[tuple[float, int, int, int]] = deque()
        self._scheduler: dict[int, tuple[int, int, float]] = {}

    def add(self, step: StepRecord, cost: StepCost) -> None:
        now = self._clock()
        with self._lock:
            self._recent.append(_Windowed(now, step.elapsed_seconds, step.engine, cost, step))
            self._expire(now)

    def add_queue(self, engine: int, running: int, waiting: int, kv_cache_usage: float) -> None:
        """The engine's scheduler state at a stats update (every step, and after aborts)."""
        now = self._clock()
        with self._lock:
            self._queue.append((now, engine, running, waiting))
            self._scheduler[engine] = (running, waiting, kv_cache_usage)
            self._expire(now)

    def _expire(self, now: float) -> None:
        horizon = now - self.window_seconds
        while self._recent and self._recent[0].end < horizon:
            self._recent.popleft()
        while self._queue and self._queue[0][0] < horizon:
            self._queue.popleft()

    def queue_shares(self) -> dict[int, float]:
        """Per engine: the share of request time in the engine spent waiting for a slot, over the window.

        Each scheduler sample holds from the engine's previous sample to this one: waiting × that
        time is request-seconds queued, running × it request-seconds running.
        """
        now = self._clock()
        with self._lock:
            self._expire(now)
            samples = list(self._queue)
        waited = dict.fromkeys(range(self.engines), 0.0)
        total = dict.fromkeys(range(self.engines), 0.0)
        previous: dict[int, float] = {}
        for at, engine, running, waiting in samples:
            held = at - previous.get(engine, at)
            previous[engine] = at
            waited[engine] = waited.get(engine, 0.0) + held * waiting
            total[engine] = total.get(engine, 0.0) + held * (waiting + running)
        return {engine: waited[engine] / total[engine] if total[engine] else 0.0 for engine in total}

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
                tokens = sum(fraction * share.tokens for fraction, share in carried)
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


@dataclass(frozen=True, slots=True)
class Interference:
    """What other requests' prefill cost a decoding request (or, as running totals, an engine's decodes)."""

    stalled_seconds: float = 0.0
    """Decode time spent in steps that also carried prefill chunks."""
    extra_seconds: float = 0.0
    """The estimated extra time those chunks cost: each such step's time minus what a decode-only
    step of the same batch takes (the engine's own recent decode-only steps)."""

    def __sub__(self, other: Interference) -> Interference:
        return Interference(self.stalled_seconds - other.stalled_seconds, self.extra_seconds - other.extra_seconds)


_NO_INTERFERENCE = Interference()

DECODE_REFERENCE_SMOOTHING = 0.2
"""Weight of the newest decode-only step in the per-batch-size reference (an exponential average)."""


class InterferenceLedger:
    """Per engine, running totals of `Interference`, advanced once per engine step.

    The engine's steps and its requests' tokens come from the same engine-core output batches:
    vLLM's output handler hands a batch's tokens to the requests and then reports the batch's step
    (phasescope.engine.vllm.stats), so a request that reads the totals when its tokens arrive and
    again when it finishes gets the steps of its decode. The reference for "a decode-only step of
    the same batch" is the exponential average of this engine's decode-only steps of that batch
    size, else of the nearest batch size seen; before any decode-only step, the roofline split
    of the mixed step (its decode share of the time) stands in.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals: dict[int, Interference] = {}
        self._decode_only: dict[int, dict[int, float]] = {}

    def record(self, step: StepRecord, decode_share_seconds: float) -> None:
        kind = step.kind
        if kind == "prefill" or step.decode_requests == 0:
            return
        with self._lock:
            references = self._decode_only.setdefault(step.engine, {})
            if kind == "decode":
                old = references.get(step.decode_requests)
                references[step.decode_requests] = (
                    step.elapsed_seconds
                    if old is None
                    else old + DECODE_REFERENCE_SMOOTHING * (step.elapsed_seconds - old)
                )
                return
            reference = references.get(step.decode_requests)
            if reference is None and references:
                nearest = min(references, key=lambda batch: abs(batch - step.decode_requests))
                reference = references[nearest]
            alone = reference if reference is not None else decode_share_seconds
            total = self._totals.get(step.engine, Interference())
            self._totals[step.engine] = Interference(
                total.stalled_seconds + step.elapsed_seconds,
                total.extra_seconds + max(0.0, step.elapsed_seconds - alone),
            )

    def read(self, engine: int) -> Interference:
        """The engine's running totals; the same object until its next mixed step (read once per request
        per output pass, so it takes no lock: `record` replaces the totals whole, never mutates them)."""
        return self._totals.get(engine, _NO_INTERFERENCE)
