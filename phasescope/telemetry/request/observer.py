"""The interface between the request path and where its figures are sent.

The request path calls these methods and nothing else; Prometheus, tracing
and logging are implementations (the pattern of vLLM's `StatLoggerBase`).
Figures are reported when they become known, not when the request ends: the
first token's stages at the first token, tokens as they stream, so a long
generation shows up in every scrape. Implementations must be cheap and must
not raise.

`ObserverGroup` can hold the first-token and end-of-request records of the observers that allow it
(`HoldsRecords`: the Prometheus series and the live view's latencies) for a moment and hand them on
together, off the path of the requests that arrive meanwhile: when a wave of streams ends at once,
the last wave's records are observed once every request of the next wave has its first token. Such an
observer hands on what is held before anything reads it (a scrape, a live view), so no reader sees
a figure late.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, Protocol, runtime_checkable

from phasescope.telemetry.held import HandOnSoon
from phasescope.telemetry.request.phases import FirstTokenRecord, PhaseRecord


class RequestObserver(Protocol):
    def request_started(self, model: str) -> None:
        """A request was admitted and is now in flight."""

    def request_first_token(self, record: FirstTokenRecord) -> None:
        """An admitted request's first token arrived (streams: once its chunk was written)."""

    def tokens_generated(self, model: str, count: int) -> None:
        """An admitted request produced `count` more output tokens."""

    def request_finished(self, record: PhaseRecord) -> None:
        """An admitted request ended, successfully or not."""

    def request_rejected(self, model: str, reason: str) -> None:
        """A request was refused before it reached the engine."""


MAX_HELD_RECORDS = 4096
"""Held records beyond which they are handed on at once, whatever the hold's time (a bound on memory)."""


@runtime_checkable
class HoldsRecords(Protocol):
    """An observer whose first-token and end-of-request records may be held (`ObserverGroup`'s `hold_seconds`)."""

    def read_after(self, hand_on: Callable[[], None]) -> None:
        """Its records are held: call `hand_on` before anything reads what it keeps."""


def _ignore(component: str, exc: BaseException) -> None:
    """Where contained errors go when nobody counts them."""


class ObserverGroup:
    """Fans every call out to several observers; one failing does not stop the others or the request.

    With `hold_seconds` above 0, the first-token and end-of-request records of the observers that allow
    it (`HoldsRecords`) are held, in order, and handed on as soon as no request waits for its first token
    (`hand_on_soon`, which the request path calls), at the latest `hold_seconds` after the first of them
    was held (a timer on the running event loop), when `MAX_HELD_RECORDS` are held, or when such an
    observer is read (it calls `hand_on` first: a scrape before it collects, the live view before its
    figures). The other observers get them at once (a span is parented by the context current when
    the request ends). Thread-safe: a scrape hands on from its own thread while the event loop holds
    more."""

    def __init__(
        self,
        observers: Iterable[RequestObserver],
        on_error: Callable[[str, BaseException], None] = _ignore,
        *,
        hold_seconds: float = 0.0,
    ) -> None:
        """`on_error` receives each contained exception (phasescope.telemetry.errors.TelemetryErrors counts them)."""
        self._observers = tuple(observers)
        self._on_error = on_error
        # Called for every streamed chunk: the bound methods, looked up once, of the observers that count
        # tokens (one that sets `counts_tokens = False` does nothing with them, and is not called per chunk).
        self._token_sinks = tuple(
            observer.tokens_generated for observer in self._observers if getattr(observer, "counts_tokens", True)
        )
        self._hold_seconds = hold_seconds
        holding = hold_seconds > 0.0
        holders = [o for o in self._observers if holding and isinstance(o, HoldsRecords)]
        for holder in holders:
            holder.read_after(self.hand_on)
        self._held_observers: tuple[RequestObserver, ...] = tuple(holders)
        self._direct_observers = tuple(o for o in self._observers if o not in self._held_observers)
        # (method name, record or what builds it, whether it is built yet), oldest first: appended on the
        # event loop, taken by whoever hands on.
        self._held: deque[tuple[str, Any, bool]] = deque()
        self._delivery = threading.Lock()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_loop: asyncio.AbstractEventLoop | None = None
        # What `hand_on_soon` runs: after the loop's ready callbacks, while no request waits for its first token.
        self._soon = HandOnSoon(self._soon_hand_on)

    @property
    def held(self) -> int:
        """Records held now."""
        return len(self._held)

    def _fan_out(self, method: str, *args: object) -> None:
        self._call(self._observers, method, args)

    def _call(self, observers: tuple[RequestObserver, ...], method: str, args: tuple[object, ...]) -> None:
        for observer in observers:
            try:
                getattr(observer, method)(*args)
            except Exception as exc:
                self._on_error("observer", exc)

    def _hold(self, method: str, record: object, built: bool = True) -> None:
        if not self._held_observers:
            self._call(self._observers, method, (record,))
            return
        if self._direct_observers:
            self._call(self._direct_observers, method, (record,))
        self._held.append((method, record, built))
        if len(self._held) >= MAX_HELD_RECORDS:
            self.hand_on()
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not on an event loop: nothing would hand them on later
            self.hand_on()
            return
        # One timer at a time (a new one on another loop: a closed loop's never fires).
        if self._timer is None or self._timer_loop is not loop:
            self._timer_loop = loop
            self._timer = loop.call_later(self._hold_seconds, self._timed_hand_on)

    def _timed_hand_on(self) -> None:
        self._timer = None
        self.hand_on()

    def hand_on(self) -> None:
        """Deliver every held record to its observers, in the order they came (readers call this first)."""
        with self._delivery:
            held = self._held
            while held:
                method, record, built = held.popleft()
                if not built:
                    try:
                        record = record()
                    except Exception as exc:  # a record that cannot be built costs that record only
                        self._on_error("observer", exc)
                        continue
                self._call(self._held_observers, method, (record,))

    def request_started(self, model: str) -> None:
        self._fan_out("request_started", model)

    def request_first_token(self, record: FirstTokenRecord) -> None:
        self._hold("request_first_token", record)

    def tokens_generated(self, model: str, count: int) -> None:
        for sink in self._token_sinks:
            try:
                sink(model, count)
            except Exception as exc:
                self._on_error("observer", exc)

    def request_finished(self, record: PhaseRecord) -> None:
        self._hold("request_finished", record)

    def request_first_token_later(self, build: Callable[[], FirstTokenRecord]) -> None:
        """A first token's record, built only when it is handed on if every observer holds records; built now
        when any observer takes it at once."""
        self._later("request_first_token", build)

    def request_finished_later(self, build: Callable[[], PhaseRecord]) -> None:
        """An ended request's record, built only when it is handed on if every observer holds records
        (building it is most of what a request's end costs); built now when any observer takes it at once."""
        self._later("request_finished", build)

    def _later(self, method: str, build: Callable[[], object]) -> None:
        if self._direct_observers or not self._held_observers:
            try:
                record = build()
            except Exception as exc:
                self._on_error("observer", exc)
                return
            self._hold(method, record)
            return
        self._hold(method, build, built=False)

    def hand_on_soon(self) -> None:
        """No request waits for its first token now (the request path says so): what is held is handed on once
        the event loop has run what is ready (the chunks just made), if still no request waits then (else at the
        next such moment: `HandOnSoon`), not at the hold's end, which could fall while the next requests wait
        for theirs. Nothing is done when nothing is held."""
        if self._held:
            self._soon()

    def _soon_hand_on(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.hand_on()

    def request_rejected(self, model: str, reason: str) -> None:
        self._fan_out("request_rejected", model, reason)
