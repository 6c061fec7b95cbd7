"""What is held and handed on together: a scrape hands it on before it collects the series it feeds.

The step reports (`StepAggregator`) and the request records (`ObserverGroup`) are held for a moment
and handed on in batches; `HandOnFirst`, registered before the series they feed (a registry collects
in registration order), makes every scrape count all of them. A batch that fills up on the event loop
is handed on once the loop has run what it had ready (`HandOnSoon`).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator, Sequence

import numpy as np
from prometheus_client import Histogram
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.values import MutexValue


def nothing_held() -> None:
    """Hands on nothing: nothing is held."""


class HandOnSoon:
    """Runs `hand_on` once the event loop has run what is ready now, instead of at once.

    A batch of held reports fills up in vLLM's output handler, right after it has handed an engine step's
    outputs to their requests and before any of them has written its chunk: handed on there, the batch
    (milliseconds of work) would make every stream of that step wait. Called with the loop's ready
    callbacks queued first, it runs after those chunks are written. Off the event loop (no loop running
    in the calling thread) it runs at once. Asked again before it ran, it runs once."""

    def __init__(self, hand_on: Callable[[], None]) -> None:
        self._hand_on = hand_on
        self._lock = threading.Lock()
        self._pending = False

    def __call__(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._hand_on()
            return
        with self._lock:
            if self._pending:
                return
            self._pending = True
        loop.call_soon(self._run)

    def _run(self) -> None:
        with self._lock:
            self._pending = False
        self._hand_on()


class HandOnFirst(Collector):
    """Collects nothing: calls `hand_on` (what hands on the held reports or records), so the series a scrape
    collects after it count everything so far. `hand_on` may be set after registration."""

    def __init__(self, hand_on: Callable[[], None] = nothing_held) -> None:
        self.hand_on = hand_on

    def collect(self) -> Iterator[Metric]:
        self.hand_on()
        return iter(())


def observe_all(histogram: Histogram, amounts: Sequence[float]) -> None:
    """`histogram.observe(amount)` for each of `amounts` in order, with the same result to the bit (each
    bucket's count, and the sum added up in the same order), in one pass: a held batch's thousands of
    inter-token gaps cost tens of microseconds instead of a lock and a bucket search each.

    `histogram` is a labelled child (or a histogram without labels), observed only by the caller while this
    runs. prometheus-client has no observe-many: this reads its bucket layout (`_upper_bounds`, `_buckets`,
    `_sum`, stable since 0.4), as tests/unit/telemetry/test_observe_all.py checks. In its multiprocess mode
    (values in shared files, not `MutexValue`) each amount is observed on its own."""
    if not amounts:
        return
    histogram._raise_if_not_observable()  # type: ignore[no-untyped-call]  # a labelled child, as observe() checks
    total, buckets = histogram._sum, histogram._buckets
    if type(total) is not MutexValue or any(type(bucket) is not MutexValue for bucket in buckets):
        for amount in amounts:
            histogram.observe(amount)
        return
    bounds = histogram._upper_bounds
    # observe() counts an amount in the first bucket whose bound is >= it (a NaN in none): the left insertion
    # point, past the last bucket (+Inf) for a NaN.
    counts = np.bincount(np.searchsorted(bounds, np.asarray(amounts, dtype=float), side="left"), minlength=len(bounds))
    with total._lock:
        running = total._value
        for amount in amounts:
            running += amount
        total._value = running
    for index in np.flatnonzero(counts[: len(bounds)]).tolist():
        buckets[index].inc(int(counts[index]))
