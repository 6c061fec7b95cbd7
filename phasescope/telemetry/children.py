"""Labelled children of prometheus-client metrics, each looked up once."""

from __future__ import annotations

from typing import TypeVar

from prometheus_client.metrics import MetricWrapperBase

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
