"""The interface between the request path and where its figures are sent.

The request path calls these methods and nothing else; Prometheus, tracing and the live view are
implementations (the pattern of vLLM's `StatLoggerBase`). Figures are reported when they become known, not
when the request ends: the first token's stages at the first token, tokens as they stream, so a long
generation shows up in every scrape. Implementations must be cheap and must not raise.

`ObserverGroup` fans each call out. The first-token and end records of the observers read in batches (the
Prometheus series, the live view) wait in the telemetry pipeline (phasescope.telemetry.pipeline) with the
engine's step reports and are handed on together; the others (tracing: a span is parented by the context
current when its request ends) get them at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

from phasescope.telemetry.pipeline import TelemetryPipeline
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
    """Fans every call out to several observers; one failing does not stop the others or the request.

    The records of the `batched` observers wait in `pipeline` (when there is one); `direct` observers get
    every call at once."""

    def __init__(
        self,
        direct: Iterable[RequestObserver] = (),
        batched: Iterable[RequestObserver] = (),
        *,
        pipeline: TelemetryPipeline | None = None,
        on_error: Callable[[str, BaseException], None] = _ignore,
    ) -> None:
        """`on_error` receives each contained exception (phasescope.telemetry.errors.TelemetryErrors counts them)."""
        self._direct = tuple(direct)
        self._batched = tuple(batched)
        self._all = (*self._direct, *self._batched)
        # Called for every step of every request: each observer's method, looked up once.
        self._token_counters = tuple(observer.tokens_generated for observer in self._all)
        self._pipeline = pipeline
        self._on_error = on_error

    def _call(self, observers: tuple[RequestObserver, ...], method: str, *args: object) -> None:
        for observer in observers:
            try:
                getattr(observer, method)(*args)
            except Exception as exc:
                self._on_error("observer", exc)

    def _record(self, method: str, record: object) -> None:
        self._call(self._direct, method, record)
        if self._pipeline is None:
            self._call(self._batched, method, record)
        elif self._batched:
            self._pipeline.hold(self._call, self._batched, method, record)

    def request_started(self, model: str) -> None:
        self._call(self._all, "request_started", model)

    def request_first_token(self, record: FirstTokenRecord) -> None:
        self._record("request_first_token", record)

    def tokens_generated(self, model: str, count: int) -> None:
        for count_tokens in self._token_counters:
            try:
                count_tokens(model, count)
            except Exception as exc:
                self._on_error("observer", exc)

    def request_finished(self, record: PhaseRecord) -> None:
        self._record("request_finished", record)

    def request_rejected(self, model: str, reason: str) -> None:
        self._call(self._all, "request_rejected", model, reason)
