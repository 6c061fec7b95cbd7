"""What is held and handed on together: a scrape hands it on before it collects the series it feeds.

The step reports (`StepAggregator`) and the request records (`ObserverGroup`) are held for a moment
and handed on in batches; `HandOnFirst`, registered before the series they feed (a registry collects
in registration order), makes every scrape count all of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector


def nothing_held() -> None:
    """Hands on nothing: nothing is held."""


class HandOnFirst(Collector):
    """Collects nothing: calls `hand_on` (what hands on the held reports or records), so the series a scrape
    collects after it count everything so far. `hand_on` may be set after registration."""

    def __init__(self, hand_on: Callable[[], None] = nothing_held) -> None:
        self.hand_on = hand_on

    def collect(self) -> Iterator[Metric]:
        self.hand_on()
        return iter(())
