"""The interface between the request path and where its figures are sent.

The request path calls these methods and nothing else; Prometheus, tracing
and logging are implementations (the pattern of vLLM's `StatLoggerBase`).
Figures are reported when they become known, not when the request ends: the
first token's stages at the first token, tokens as they stream, so a long
generation shows up in every scrape. Implementations must be cheap and must
not raise.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

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


def _ignore(component: str, exc: BaseException) -> None:
    """Where contained errors go when nobody counts them."""


class ObserverGroup:
    """Fans every call out to several observers; one failing does not stop the others or the request."""

    def __init__(
        self,
        observers: Iterable[RequestObserver],
        on_error: Callable[[str, BaseException], None] = _ignore,
    ) -> None:
        """`on_error` receives each contained exception (phasescope.telemetry.errors.TelemetryErrors counts them)."""
        self._observers = tuple(observers)
        self._on_error = on_error
        # Called for every streamed chunk: the bound methods, looked up once, of the observers that count
        # tokens (one that sets `counts_tokens = False` does nothing with them, and is not called per chunk).
        self._token_sinks = tuple(
            observer.tokens_generated for observer in self._observers if getattr(observer, "counts_tokens", True)
        )

    def _fan_out(self, method: str, *args: object) -> None:
        for observer in self._observers:
            try:
                getattr(observer, method)(*args)
            except Exception as exc:
                self._on_error("observer", exc)

    def request_started(self, model: str) -> None:
        self._fan_out("request_started", model)

    def request_first_token(self, record: FirstTokenRecord) -> None:
        self._fan_out("request_first_token", record)

    def tokens_generated(self, model: str, count: int) -> None:
        for sink in self._token_sinks:
            try:
                sink(model, count)
            except Exception as exc:
                self._on_error("observer", exc)

    def request_finished(self, record: PhaseRecord) -> None:
        self._fan_out("request_finished", record)

    def request_rejected(self, model: str, reason: str) -> None:
        self._fan_out("request_rejected", model, reason)
