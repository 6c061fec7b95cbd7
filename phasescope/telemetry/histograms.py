"""Observing many amounts into one Prometheus histogram at once."""

from __future__ import annotations

import bisect
import weakref
from collections.abc import Sequence

import numpy as np
from prometheus_client import Histogram
from prometheus_client.values import MutexValue

_LAYOUTS: weakref.WeakKeyDictionary[Histogram, np.ndarray | None] = weakref.WeakKeyDictionary()
"""Each histogram's bucket bounds as an array, None for one whose values are not `MutexValue`s: read once."""


def _layout(histogram: Histogram) -> np.ndarray | None:
    try:
        return _LAYOUTS[histogram]
    except KeyError:
        pass
    total, buckets = histogram._sum, histogram._buckets
    in_process = type(total) is MutexValue and all(type(bucket) is MutexValue for bucket in buckets)
    layout = np.asarray(histogram._upper_bounds, dtype=float) if in_process else None
    _LAYOUTS[histogram] = layout
    return layout


def observe_all(histogram: Histogram, amounts: Sequence[float]) -> None:
    """`histogram.observe(amount)` for each of `amounts` in order, with the same result to the bit (each
    bucket's count, and the sum added up in the same order), in one pass and under no lock per amount
    (docs/benchmarks.md, "What the telemetry costs").

    `histogram` is a labelled child (or a histogram without labels), observed only by the caller while this
    runs. prometheus-client has no observe-many: this reads its bucket layout (`_upper_bounds`, `_buckets`,
    `_sum`, stable since 0.4; once per histogram), as tests/unit/telemetry/test_observe_all.py checks. In its
    multiprocess mode (values in shared files, not `MutexValue`) each amount is observed on its own."""
    if not amounts:
        return
    histogram._raise_if_not_observable()  # type: ignore[no-untyped-call]  # a labelled child, as observe() checks
    bounds = _layout(histogram)
    if bounds is None:
        for amount in amounts:
            histogram.observe(amount)
        return
    total, buckets = histogram._sum, histogram._buckets
    with total._lock:
        running = total._value
        for amount in amounts:
            running += amount
        total._value = running
    # observe() counts an amount in the first bucket whose bound is >= it (a NaN in none): the left insertion
    # point, past the last bucket (+Inf) for a NaN.
    first = amounts[0]
    if amounts.count(first) == len(amounts):
        # All one value, as an engine step's inter-token gaps most often are (each request that decoded got its
        # previous token from the previous step): one bucket.
        index = int(bounds.searchsorted(first, side="left"))
        if index < len(bounds):
            buckets[index].inc(len(amounts))
        return
    counts = np.bincount(bounds.searchsorted(np.asarray(amounts, dtype=float), side="left"), minlength=len(bounds))
    counted = counts[: len(bounds)].nonzero()[0]
    for index, count in zip(counted.tolist(), counts[counted].tolist(), strict=True):
        buckets[index].inc(count)


def observe_counted(histogram: Histogram, amounts: Sequence[float], counts: Sequence[int]) -> None:
    """`histogram.observe(amount)` `count` times for each of `amounts` and its count in `counts`: each bucket's
    count as those calls leave it, and the sum up to rounding (each amount × its count is added once, in order),
    under no lock per amount. For an engine step's inter-token gaps, sent as runs of requests with one gap and the
    runs' lengths (`records.EngineIteration`). The same reading of prometheus-client's layout as `observe_all`."""
    if not amounts:
        return
    histogram._raise_if_not_observable()  # type: ignore[no-untyped-call]  # a labelled child, as observe() checks
    if _layout(histogram) is None:
        for amount, count in zip(amounts, counts, strict=True):
            for _ in range(count):
                histogram.observe(amount)
        return
    total, buckets, bounds = histogram._sum, histogram._buckets, histogram._upper_bounds
    with total._lock:
        running = total._value
        for amount, count in zip(amounts, counts, strict=True):
            running += amount * count
        total._value = running
    last = len(bounds)
    for amount, count in zip(amounts, counts, strict=True):
        # observe() counts an amount in the first bucket whose bound is >= it; a NaN in none.
        index = bisect.bisect_left(bounds, amount)
        if index < last and amount == amount:
            buckets[index].inc(count)
