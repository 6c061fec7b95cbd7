"""Observing many amounts into one Prometheus histogram at once."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from prometheus_client import Histogram
from prometheus_client.values import MutexValue


def observe_all(histogram: Histogram, amounts: Sequence[float]) -> None:
    """`histogram.observe(amount)` for each of `amounts` in order, with the same result to the bit (each
    bucket's count, and the sum added up in the same order), in one pass and under no lock per amount
    (docs/benchmarks.md says what it measured as).

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
