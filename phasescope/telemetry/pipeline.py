"""The one place telemetry waits before it is handed on.

Three kinds of report are made on the path every token takes: each request's first-token and end records
(for the Prometheus series and the live view), each engine step's report (the step aggregator), and vLLM's own
stats updates (its `vllm:` series). Handed on as they come, their bookkeeping runs between an engine step's
outputs and the chunks those outputs become, and a wave of new requests waits for its first tokens behind it
(docs/benchmarks.md, "Settings that change the cost per token"). So each report is held here, as the call
that delivers it, in the order it came, and handed on:

- once `batch` reports are held, after the event loop has run what was ready (the chunks just made), and only
  while no request waits for its first token (`FirstTokenWaits`), waiting at most `longest_wait_seconds` for
  that moment;
- whenever something reads what they feed: a scrape (`scrape_hook`, registered before every series), the live
  view, `GetLoads` (`hand_on`). No reader sees a figure late.

A report that raises when delivered costs that report only (`on_error`). Thread-safe: a scrape hands on from
its own thread while the event loop holds more.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from typing import TypeVarTuple

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

Args = TypeVarTuple("Args")

DEFAULT_BATCH = 96
"""Reports held before they are handed on (about one engine step of a full batch's records and reports)."""


def _ignore(component: str, exc: BaseException) -> None:
    """Where contained errors go when nobody counts them."""


class FirstTokenWaits:
    """How many requests wait for their first chunk, from their handler's entry: the request path counts them,
    the pipeline waits while any does."""

    def __init__(self) -> None:
        self.count = 0

    def started(self) -> None:
        self.count += 1

    def settled(self) -> None:
        self.count -= 1

    def __bool__(self) -> bool:
        return self.count > 0


class _HandOnFirst(Collector):
    """Collects nothing: hands on what is held, so the series a scrape collects after it count everything."""

    def __init__(self, hand_on: Callable[[], None]) -> None:
        self._hand_on = hand_on

    def collect(self) -> Iterator[Metric]:
        self._hand_on()
        return iter(())


class TelemetryPipeline:
    """Holds reports (each a call and its arguments) and hands them on together, in order."""

    recheck_seconds = 0.002
    """How often a batch waiting for the first tokens looks again."""

    def __init__(
        self,
        waits: FirstTokenWaits | None = None,
        *,
        batch: int = DEFAULT_BATCH,
        longest_wait_seconds: float = 1.0,
        on_error: Callable[[str, BaseException], None] = _ignore,
    ) -> None:
        self.waits = waits if waits is not None else FirstTokenWaits()
        self._batch = max(1, batch)
        self._longest_wait = longest_wait_seconds
        self.on_error = on_error
        # Each call was checked against its arguments where `hold` was called; held, they are only delivered.
        self._held: list[tuple[Callable[..., None], tuple[object, ...]]] = []
        self._lock = threading.Lock()
        # One delivery at a time (the event loop's, a scrape's), so reports arrive in the order they came.
        self._delivery = threading.Lock()
        self._scheduled = False

    @property
    def held(self) -> int:
        """Reports held now."""
        return len(self._held)

    def hold(self, deliver: Callable[[*Args], None], *args: *Args) -> None:
        """Hold `deliver(*args)` until the batch is handed on (`deliver` a declared method, bound: no names)."""
        with self._lock:
            self._held.append((deliver, args))
            full = len(self._held) >= self._batch and not self._scheduled
            if full:
                self._scheduled = True
        if full:
            self._hand_on_soon()

    def hand_on(self) -> None:
        """Deliver every held report, in the order they came (every reader calls this first)."""
        with self._delivery:
            with self._lock:
                held, self._held = self._held, []
                self._scheduled = False
            for deliver, args in held:
                try:
                    deliver(*args)
                except Exception as exc:  # a report that cannot be delivered costs that report only
                    self.on_error("step", exc)  # the engine's reports (observers contain their own)

    def scrape_hook(self) -> Collector:
        """Register it in a registry before the series it feeds: a registry collects in registration order."""
        return _HandOnFirst(self.hand_on)

    def _hand_on_soon(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # off the event loop: nothing would run it later
            self.hand_on()
            return
        loop.call_soon(self._when_no_request_waits, loop, loop.time())

    def _when_no_request_waits(self, loop: asyncio.AbstractEventLoop, asked: float) -> None:
        if self.waits and loop.time() - asked < self._longest_wait:
            loop.call_later(self.recheck_seconds, self._when_no_request_waits, loop, asked)
            return
        self.hand_on()
