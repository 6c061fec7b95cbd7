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


def nobody_waits() -> bool:
    """No request waits for its first token (what a process serving no requests says)."""
    return False


class FirstTokenWaits:
    """Whether some request of this process waits for its first token: a batch of held telemetry waits for the
    moment none does (`HandOnSoon`). The server points it at its request path (`watch`); each batch's wait is
    bounded (`HandOnSoon.longest_wait`)."""

    def __init__(self) -> None:
        self.waiting: Callable[[], bool] = nobody_waits

    def watch(self, waiting: Callable[[], bool]) -> None:
        self.waiting = waiting


FIRST_TOKEN_WAITS = FirstTokenWaits()
"""The process's: vLLM makes its stat loggers itself, so theirs is found here, not handed in."""


class HandOnSoon:
    """Runs `hand_on` once the event loop has run what is ready now, instead of at once, and while no request
    waits for its first token.

    A batch of held reports fills up in vLLM's output handler, right after it has handed an engine step's
    outputs to their requests and before any of them has written its chunk: handed on there, the batch
    (milliseconds of work) would make every stream of that step wait. Called with the loop's ready
    callbacks queued first, it runs after those chunks are written. While a request waits for its first
    token (`FirstTokenWaits`: a wave of new requests being taken in, their prefills being scheduled), the
    batch waits too, looking again every `recheck_seconds`, for at most `longest_wait` seconds: a stall of
    milliseconds there would delay every first token behind it. Off the event loop (no loop running in the
    calling thread) it runs at once. Asked again before it ran, it runs once."""

    recheck_seconds = 0.002
    longest_wait = 1.0

    def __init__(self, hand_on: Callable[[], None], waits: FirstTokenWaits = FIRST_TOKEN_WAITS) -> None:
        self._hand_on = hand_on
        self._waits = waits
        self._lock = threading.Lock()
        self._pending = False
        self._asked = 0.0

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
        self._asked = loop.time()
        loop.call_soon(self._run, loop)

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._waits.waiting() and loop.time() - self._asked < self.longest_wait:
            loop.call_later(self.recheck_seconds, self._run, loop)
            return
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
