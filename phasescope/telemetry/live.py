"""Recent latencies over a sliding window, for live views (WatchTelemetry, `phasescope top`).

Prometheus histograms answer "p99 over any PromQL window" but a live view wants the
quantiles of the last few seconds now, without a Prometheus. This keeps each request's
figures for a bounded time (and count) and computes quantiles only when asked: a
request costs one append per figure; nothing is computed unless someone watches.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from phasescope.telemetry.request.adapters import BASE_ADAPTER
from phasescope.telemetry.request.phases import FirstTokenRecord, PhaseRecord
from phasescope.telemetry.step.aggregator import StepSink
from phasescope.telemetry.step.records import EngineIteration

# At most this many observations are kept per figure, whatever the window.
MAX_OBSERVATIONS = 20_000


def percentile(values: Sequence[float], p: float) -> float:
    """The `p`th percentile (0-100) of unsorted values as vLLM's `bench serve` computes it (numpy's linear
    interpolation between the closest ranks); 0.0 when there are none, as an idle window has."""
    if not values:
        return 0.0
    return float(np.percentile(values, p))


@dataclass(frozen=True, slots=True)
class LatencyFigures:
    time_to_first_token_p50: float
    time_to_first_token_p99: float
    time_to_first_token_samples: int
    inter_token_p50: float
    inter_token_p99: float
    inter_token_samples: int
    queue_mean: float
    prefill_mean: float
    decode_mean: float
    kv_transfer_mean: float = 0.0
    """Of the requests that moved KV through a connector."""


class _Recent:
    """(time, values, counts) of one figure, dropped after `horizon` seconds or beyond the cap (`MAX_OBSERVATIONS`
    values, the oldest first). Kept as one entry per report: an engine step's inter-token gaps cost one entry, each
    run of requests with one gap once with its length, not one per gap."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._batches: deque[tuple[float, Sequence[float], Sequence[int] | None, int]] = deque()
        self._count = 0

    def add(self, value: float) -> None:
        self.extend((value,))

    def extend(self, values: Sequence[float], at: float | None = None, counts: Sequence[int] | None = None) -> None:
        """Values observed at `at` (None: now), on this keeper's clock, each `counts` times (None: once)."""
        if not values:
            return
        size = sum(counts) if counts is not None else len(values)
        self._batches.append((self._clock() if at is None else at, values, counts, size))
        self._count += size
        while self._count > MAX_OBSERVATIONS:
            self._count -= self._batches.popleft()[3]

    def since(self, start: float) -> list[float]:
        while self._batches and self._batches[0][0] < start - 60.0:
            self._count -= self._batches.popleft()[3]  # older than any window a live view asks for
        kept: list[float] = []
        for at, values, counts, _ in self._batches:
            if at < start:
                continue
            if counts is None:
                kept.extend(values)
            else:
                for value, count in zip(values, counts, strict=True):
                    kept.extend([value] * count)
        return kept


class RecentLatencies(StepSink):
    """A request observer (phasescope.telemetry.request.observer) keeping the last minutes' latencies, and a
    sink of the engine's steps for their inter-token gaps. Thread-safe: the step reports and the request
    path both add."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._ttft = _Recent(clock)
        self._itl = _Recent(clock)
        self._queue = _Recent(clock)
        self._prefill = _Recent(clock)
        self._decode = _Recent(clock)
        self._kv_transfer = _Recent(clock)
        self.rejected = 0
        """Requests refused before the engine, since start (a watcher diffs it)."""

    def request_started(self, model: str, adapter: str = BASE_ADAPTER) -> None:
        pass

    def request_first_token(self, record: FirstTokenRecord) -> None:
        timings = record.timings
        with self._lock:
            if timings.time_to_first_token_seconds is not None:
                self._ttft.add(timings.time_to_first_token_seconds)
            if timings.queue_seconds is not None:
                self._queue.add(timings.queue_seconds)
            if timings.prefill_seconds is not None:
                self._prefill.add(timings.prefill_seconds)

    def tokens_generated(self, model: str, count: int, adapter: str = BASE_ADAPTER) -> None:
        pass

    def request_finished(self, record: PhaseRecord) -> None:
        # Each sample's decode (the only one's for n = 1).
        for timings, tokens in [(sample.timings, sample.completion_tokens) for sample in record.samples] or [
            (record.timings, record.completion_tokens)
        ]:
            if timings.decode_seconds is not None and tokens > 1:
                with self._lock:
                    self._decode.add(timings.decode_seconds)
        if record.timings.kv_transfer_seconds is not None:
            with self._lock:
                self._kv_transfer.add(record.timings.kv_transfer_seconds)

    def request_rejected(self, model: str, reason: str, adapter: str = BASE_ADAPTER) -> None:
        with self._lock:
            self.rejected += 1

    def iteration(self, iteration: EngineIteration, at: float | None = None) -> None:
        """The engine's inter-token gaps of one output batch, reported at `at` (None: now)."""
        with self._lock:
            self._itl.extend(iteration.inter_token_seconds, at, iteration.gap_counts())

    def figures(self, window_seconds: float) -> LatencyFigures:
        """The latencies of the last `window_seconds` (what the telemetry pipeline holds is not in them: its
        reader hands it on first)."""
        start = self._clock() - window_seconds
        with self._lock:
            ttft = self._ttft.since(start)
            itl = self._itl.since(start)
            queue, prefill, decode = self._queue.since(start), self._prefill.since(start), self._decode.since(start)
            kv_transfer = self._kv_transfer.since(start)

        def mean(values: list[float]) -> float:
            return sum(values) / len(values) if values else 0.0

        return LatencyFigures(
            time_to_first_token_p50=percentile(ttft, 50),
            time_to_first_token_p99=percentile(ttft, 99),
            time_to_first_token_samples=len(ttft),
            inter_token_p50=percentile(itl, 50),
            inter_token_p99=percentile(itl, 99),
            inter_token_samples=len(itl),
            queue_mean=mean(queue),
            prefill_mean=mean(prefill),
            decode_mean=mean(decode),
            kv_transfer_mean=mean(kv_transfer),
        )
