"""Prometheus series updated many times a second: labelled children each looked up once, and counters kept as
plain sums."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from typing import TypeVar

from prometheus_client import metrics
from prometheus_client.core import CounterMetricFamily
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

M = TypeVar("M", bound=MetricWrapperBase)


class Children:
    """`children(metric, *values)` is `metric.labels(*values)`, built on the first call and a dict lookup after.

    prometheus-client's `labels()` checks and joins the values and takes the metric's lock on every call; the
    series a step or a request touches are looked up many times a second, with few distinct label values (model,
    engine, phase, stage). Nothing in phasescope removes a child, so a kept one stays valid.
    """

    __slots__ = ("_made",)

    def __init__(self) -> None:
        self._made: dict[tuple[MetricWrapperBase, tuple[str, ...]], MetricWrapperBase] = {}

    def __call__(self, metric: M, *values: str) -> M:
        key = (metric, values)
        try:
            child = self._made[key]
        except KeyError:
            child = self._made[key] = metric.labels(*values)
        return child  # type: ignore[return-value]  # made by metric.labels, so of metric's own type


class CounterSeries:
    """One series of a `SumCounter`: its total since it was made, and when (Unix time)."""

    __slots__ = ("created", "total")

    def __init__(self) -> None:
        self.total = 0.0
        self.created = time.time()

    def inc(self, amount: float) -> None:
        """Add `amount` (not negative, as `Counter.inc` asks)."""
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        self.total += amount


class SumCounter(Collector):
    """A counter family kept as plain sums. It exports what a prometheus-client `Counter` with the same name, help
    and label names exports: each series' `_total` sample and, unless created series are disabled
    (`disable_created_metrics`), its `_created` one, the series in the order they were first touched.

    `Counter.inc` checks its amount and takes a lock to add it; here an increment is a dict lookup and a float
    addition. One thread at a time increments (the telemetry's delivery); a scrape reads from another. Making a
    series takes a lock, as the scrape's copy of the series does; an increment replaces its series' total whole,
    so a scrape reads it before or after, as it would a `Counter`'s.
    """

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str]) -> None:
        """Registers nothing: whoever exports it registers it, or collects it as part of its own collector."""
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._series: dict[tuple[str, ...], CounterSeries] = {}
        self._lock = threading.Lock()

    def labels(self, *values: str) -> CounterSeries:
        """The series of these label values, made at 0 on the first call."""
        try:
            return self._series[values]
        except KeyError:
            pass
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name}: {len(self.labelnames)} label values expected, got {values!r}")
        with self._lock:
            return self._series.setdefault(values, CounterSeries())

    def inc(self, amount: float, *values: str) -> None:
        """Add `amount` (not negative, as `Counter.inc` asks) to the series of these label values."""
        self.labels(*values).inc(amount)

    def _family(self) -> CounterMetricFamily:
        return CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def describe(self) -> Iterator[CounterMetricFamily]:
        yield self._family()

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = self._family()
        # prometheus-client's own switch (`disable_created_metrics`), read as its Counter reads it, at each scrape.
        created = metrics._use_created
        with self._lock:
            series = list(self._series.items())
        for values, one in series:
            family.add_metric(values, one.total, one.created if created else None)
        yield family
