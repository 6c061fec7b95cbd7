"""Per-engine-step figures: tokens/s per phase, bandwidth saturation and compute idleness.

The engine reports every step (server.vllm_stats turns vLLM's SchedulerStats
into a `StepRecord`). `RooflineTracker` keeps counters since start, so any
window can be computed in PromQL, and exposes gauges over a short sliding
window, computed when scraped, so an idle engine reads 0 utilisation and 1
idleness instead of its last busy value.

Mixed steps (chunked prefill: some requests still prefilling while others
decode) are split between the phases in proportion to their token counts:
each phase gets that share of the step's time, FLOPs and bytes. For FLOPs the
split is exact (≈ 2 × parameters per token in either phase); the weight read,
which both phases share, is divided the same way.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from telemetry.hardware import HardwarePeaks
from telemetry.model_cost import ModelCost

PHASES = ("prefill", "decode")
DEFAULT_WINDOW_SECONDS = 10.0


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One engine step, as the engine core accounted it."""

    engine: int
    prefill_requests: int
    prefill_tokens: int
    decode_requests: int
    decode_tokens: int
    elapsed_seconds: float
    """The step's execution time, measured in the engine core."""
    flops: float | None = None
    """The engine's own estimate for the step (vLLM --enable-mfu-metrics), per device."""
    read_bytes: float | None = None
    kv_cache_tokens: int = 0
    """Tokens held in the KV cache at this step (read once by a decode step)."""


class StepForwarder:
    """Where step records go; steps seen before a sink is attached are dropped.

    The engine needs its stat logger before it starts, the tracker needs the
    engine's dtype and device, which are known only after: this sits between.
    """

    def __init__(self) -> None:
        self.sink: Callable[[StepRecord], None] | None = None
        self.queue_sink: Callable[[int, int, int, float], None] | None = None

    def __call__(self, step: StepRecord) -> None:
        if self.sink is not None:
            self.sink(step)

    def queue(self, engine: int, running: int, waiting: int, kv_cache_usage: float) -> None:
        """The engine's scheduler state, reported with every stats update (also after aborts)."""
        if self.queue_sink is not None:
            self.queue_sink(engine, running, waiting, kv_cache_usage)


@dataclass(frozen=True, slots=True)
class PhaseShare:
    tokens: int
    requests: int
    seconds: float
    flops: float
    bytes_read: float


def model_step_cost(cost: ModelCost, step: StepRecord) -> tuple[float, float]:
    """(FLOPs, bytes read) of a step by the project's own cost model: the cross-check of the engine's estimate."""
    tokens = step.prefill_tokens + step.decode_tokens
    flops = tokens * cost.flops_per_token()
    # Bytes read ≈ weight bytes (once per step) + the KV cache of the running sequences.
    bytes_read = cost.weight_bytes + step.kv_cache_tokens * cost.kv_cache_bytes_per_token
    return flops, bytes_read


def split_by_phase(step: StepRecord, flops: float, bytes_read: float) -> dict[str, PhaseShare]:
    """Divide a step's time, FLOPs and bytes between prefill and decode by token counts."""
    total_tokens = step.prefill_tokens + step.decode_tokens
    shares: dict[str, PhaseShare] = {}
    for phase, tokens, requests in (
        ("prefill", step.prefill_tokens, step.prefill_requests),
        ("decode", step.decode_tokens, step.decode_requests),
    ):
        fraction = tokens / total_tokens if total_tokens else 0.0
        shares[phase] = PhaseShare(
            tokens=tokens,
            requests=requests,
            seconds=step.elapsed_seconds * fraction,
            flops=flops * fraction,
            bytes_read=bytes_read * fraction,
        )
    return shares


@dataclass(slots=True)
class _Windowed:
    at: float
    engine: int
    shares: dict[str, PhaseShare]
    model_flops: float
    model_bytes: float
    engine_flops: float | None
    engine_bytes: float | None


class RooflineTracker(Collector):
    """Counters and sliding-window gauges of what the engine's steps did against the device's peaks.

    `peaks_per_engine` gives the peaks each engine is judged against: on a GPU,
    its own device's; on a CPU, the machine's peaks divided by the number of
    engine cores sharing it, so that per-engine utilisations add up to the
    machine's.
    """

    def __init__(
        self,
        model: str,
        cost: ModelCost,
        dtype: str,
        peaks: HardwarePeaks,
        registry: CollectorRegistry,
        *,
        engines: int = 1,
        shared_device: bool = False,
        window_seconds: float = DEFAULT_WINDOW_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._model = model
        self._cost = cost
        self._dtype = dtype
        self._peaks = peaks
        self._share = engines if shared_device else 1
        self._engines = engines
        self._window = window_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._recent: deque[_Windowed] = deque()
        self._started = clock()
        self.flops = Counter(
            "phasescope_model_flops",
            "FLOPs the engine's steps performed, per phase (the engine's estimate when it gives one, else the "
            "cost model's: tokens × 2 × parameters).",
            ["model", "engine", "phase"],
            registry=registry,
        )
        self.bytes_read = Counter(
            "phasescope_model_bytes_read",
            "Bytes the engine's steps read from device memory, per phase (weights once per step + KV cache).",
            ["model", "engine", "phase"],
            registry=registry,
        )
        self.busy_seconds = Counter(
            "phasescope_engine_busy_seconds",
            "Seconds the engine spent executing steps, per phase (mixed steps split by token counts).",
            ["model", "engine", "phase"],
            registry=registry,
        )
        self.step_tokens = Counter(
            "phasescope_engine_step_tokens",
            "Tokens the engine's steps processed, per phase, as the engine scheduled them.",
            ["model", "engine", "phase"],
            registry=registry,
        )
        self.engine_requests = Gauge(
            "phasescope_engine_requests",
            "Requests in the engine's scheduler: running (in the batch) or waiting (queued for a slot).",
            ["model", "engine", "state"],
            registry=registry,
        )
        self.kv_cache_usage = Gauge(
            "phasescope_kv_cache_usage_ratio",
            "Share of the engine's KV-cache blocks in use (1 = full: new sequences wait or are preempted).",
            ["model", "engine"],
            registry=registry,
        )
        for engine in range(engines):
            for state in ("running", "waiting"):
                self.engine_requests.labels(model, str(engine), state).set(0)
            self.kv_cache_usage.labels(model, str(engine)).set(0)
        registry.register(self)

    def record_queue(self, engine: int, running: int, waiting: int, kv_cache_usage: float) -> None:
        self.engine_requests.labels(self._model, str(engine), "running").set(running)
        self.engine_requests.labels(self._model, str(engine), "waiting").set(waiting)
        self.kv_cache_usage.labels(self._model, str(engine)).set(kv_cache_usage)

    @property
    def peak_memory_bandwidth_bytes_per_second(self) -> float:
        """Per engine: the device's peak, shared between engines on one CPU."""
        return self._peaks.memory_bandwidth_bytes_per_second / self._share

    @property
    def peak_flops(self) -> float:
        return self._peaks.peak_flops(self._dtype) / self._share

    def record(self, step: StepRecord) -> None:
        model_flops, model_bytes = model_step_cost(self._cost, step)
        flops = step.flops if step.flops is not None else model_flops
        bytes_read = step.read_bytes if step.read_bytes is not None else model_bytes
        shares = split_by_phase(step, flops, bytes_read)
        engine = str(step.engine)
        for phase, share in shares.items():
            if share.tokens == 0:
                continue
            self.flops.labels(self._model, engine, phase).inc(share.flops)
            self.bytes_read.labels(self._model, engine, phase).inc(share.bytes_read)
            self.busy_seconds.labels(self._model, engine, phase).inc(share.seconds)
            self.step_tokens.labels(self._model, engine, phase).inc(share.tokens)
        with self._lock:
            self._recent.append(
                _Windowed(self._clock(), step.engine, shares, model_flops, model_bytes, step.flops, step.read_bytes)
            )
            self._expire()

    def _expire(self) -> None:
        horizon = self._clock() - self._window
        while self._recent and self._recent[0].at < horizon:
            self._recent.popleft()

    def window_figures(self) -> dict[tuple[int, str], dict[str, float]]:
        """Per (engine, phase): tokens/s, bandwidth and compute utilisation, intensity, batch size."""
        with self._lock:
            self._expire()
            recent = list(self._recent)
        # Before a whole window has passed, divide by the time actually observed.
        window = min(self._window, max(self._clock() - self._started, 1e-9))
        figures: dict[tuple[int, str], dict[str, float]] = {}
        for engine in range(self._engines):
            for phase in PHASES:
                shares = [entry.shares[phase] for entry in recent if entry.engine == engine]
                tokens = sum(share.tokens for share in shares)
                flops = sum(share.flops for share in shares)
                moved = sum(share.bytes_read for share in shares)
                steps_with_phase = [share for share in shares if share.tokens]
                figures[(engine, phase)] = {
                    "tokens_per_second": tokens / window,
                    # Bandwidth saturation = achieved bytes/s ÷ peak bytes/s.
                    "memory_bandwidth_utilization": moved / window / self.peak_memory_bandwidth_bytes_per_second,
                    # MFU = achieved FLOP/s ÷ peak FLOP/s; idleness = 1 − MFU.
                    "compute_utilization": flops / window / self.peak_flops,
                    # Arithmetic intensity = FLOPs ÷ bytes moved; 0 when idle.
                    "arithmetic_intensity": flops / moved if moved else 0.0,
                    "batch_size": (
                        sum(share.requests for share in steps_with_phase) / len(steps_with_phase)
                        if steps_with_phase
                        else 0.0
                    ),
                }
        return figures

    def agreement(self) -> dict[str, float]:
        """Cost model ÷ engine estimate over the window, for FLOPs and bytes (absent without engine estimates)."""
        with self._lock:
            self._expire()
            recent = [entry for entry in self._recent if entry.engine_flops is not None]
        if not recent:
            return {}
        engine_flops = sum(entry.engine_flops or 0.0 for entry in recent)
        engine_bytes = sum(entry.engine_bytes or 0.0 for entry in recent)
        result: dict[str, float] = {}
        if engine_flops:
            result["flops"] = sum(entry.model_flops for entry in recent) / engine_flops
        if engine_bytes:
            result["bytes"] = sum(entry.model_bytes for entry in recent) / engine_bytes
        return result

    def collect(self) -> Iterator[Metric]:
        figures = self.window_figures()
        families = {
            "tokens_per_second": GaugeMetricFamily(
                "phasescope_tokens_per_second",
                f"Tokens per second per phase over the last {self._window:g} s of engine steps.",
                labels=["model", "engine", "phase"],
            ),
            "memory_bandwidth_utilization": GaugeMetricFamily(
                "phasescope_memory_bandwidth_utilization_ratio",
                "Bandwidth saturation: bytes read per second ÷ the device's peak bytes/s, per phase, over the window.",
                labels=["model", "engine", "phase"],
            ),
            "compute_utilization": GaugeMetricFamily(
                "phasescope_compute_utilization_ratio",
                "Model FLOPs utilisation: FLOP/s ÷ the device's peak FLOP/s, per phase, over the window.",
                labels=["model", "engine", "phase"],
            ),
            "compute_idle": GaugeMetricFamily(
                "phasescope_compute_idle_ratio",
                "Compute idleness: 1 − compute utilisation, per phase, over the window.",
                labels=["model", "engine", "phase"],
            ),
            "arithmetic_intensity": GaugeMetricFamily(
                "phasescope_arithmetic_intensity_flops_per_byte",
                "FLOPs per byte read, per phase, over the window (0 when idle).",
                labels=["model", "engine", "phase"],
            ),
        }
        batch = GaugeMetricFamily(
            "phasescope_decode_batch_size",
            "Mean number of sequences per decode step over the window (0 when idle).",
            labels=["model", "engine"],
        )
        for (engine, phase), values in figures.items():
            labels = [self._model, str(engine), phase]
            for key in ("tokens_per_second", "memory_bandwidth_utilization", "compute_utilization"):
                families[key].add_metric(labels, values[key])
            families["compute_idle"].add_metric(labels, 1.0 - values["compute_utilization"])
            families["arithmetic_intensity"].add_metric(labels, values["arithmetic_intensity"])
            if phase == "decode":
                batch.add_metric([self._model, str(engine)], values["batch_size"])
        yield from families.values()
        yield batch
        agreement = self.agreement()
        if agreement:
            family = GaugeMetricFamily(
                "phasescope_cost_model_agreement_ratio",
                "The project's cost model ÷ the engine's own estimate over the window (1 = they agree).",
                labels=["model", "quantity"],
            )
            for quantity, ratio in agreement.items():
                family.add_metric([self._model, quantity], ratio)
            yield family
        yield from self._peak_families()

    def _peak_families(self) -> Iterator[Metric]:
        source = self._peaks.source
        bandwidth = GaugeMetricFamily(
            "phasescope_hardware_peak_memory_bandwidth_bytes_per_second",
            "Peak memory bandwidth each engine is judged against (a CPU's is shared between its engines).",
            labels=["model", "source"],
        )
        bandwidth.add_metric([self._model, source], self.peak_memory_bandwidth_bytes_per_second)
        flops = GaugeMetricFamily(
            "phasescope_hardware_peak_flops",
            "Peak dense FLOP/s in the served dtype each engine is judged against.",
            labels=["model", "source", "dtype"],
        )
        flops.add_metric([self._model, source, self._dtype], self.peak_flops)
        ridge = GaugeMetricFamily(
            "phasescope_roofline_ridge_point_flops_per_byte",
            "Ridge point = peak FLOP/s ÷ peak bytes/s: the intensity above which a step is compute-bound.",
            labels=["model"],
        )
        ridge.add_metric([self._model], self.peak_flops / self.peak_memory_bandwidth_bytes_per_second)
        info = GaugeMetricFamily(
            "phasescope_hardware_info",
            "The device the engines run on and where its peaks came from (value is always 1).",
            labels=["model", "device", "source", "engines"],
        )
        info.add_metric([self._model, self._peaks.description or self._peaks.device, source, str(self._engines)], 1.0)
        yield from (bandwidth, flops, ridge, info)
