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
from typing import Protocol, TypeVar, TypeVarTuple

from phasescope.telemetry.pipeline import TelemetryPipeline
from phasescope.telemetry.request.adapters import BASE_ADAPTER
from phasescope.telemetry.request.phases import FirstTokenRecord, PhaseRecord


class RequestObserver(Protocol):
    """`adapter` and the records' `adapter`: the request's adapter label (phasescope.telemetry.request.adapters)."""

    def request_started(self, model: str, adapter: str = BASE_ADAPTER) -> None:
        """A request was admitted and is now in flight."""

    def request_first_token(self, record: FirstTokenRecord) -> None:
        """An admitted request's first token arrived (streams: once its chunk was written)."""

    def tokens_generated(self, model: str, count: int, adapter: str = BASE_ADAPTER) -> None:
        """An admitted request produced `count` more output tokens."""

    def request_finished(self, record: PhaseRecord) -> None:
        """An admitted request ended, successfully or not."""

    def request_rejected(self, model: str, reason: str, adapter: str = BASE_ADAPTER) -> None:
        """A request was refused before it reached the engine."""


R = TypeVar("R", FirstTokenRecord, PhaseRecord)
Args = TypeVarTuple("Args")


def _ignore(component: str, exc: BaseException) -> None:
    """Where contained errors go when nobody counts them."""


class ObserverGroup:
    """Fans every call out to several observers; one failing does not stop the others or the request.

    The records of the `batched` observers wait in `pipeline` (when there is one); `direct` observers get
    every call at once. Each observer is called through the method `RequestObserver` declares, bound once here;
    the pipeline holds the batched observers' bound methods with the record they are handed."""

    def __init__(
        self,
        direct: Iterable[RequestObserver] = (),
        batched: Iterable[RequestObserver] = (),
        *,
        pipeline: TelemetryPipeline | None = None,
        on_error: Callable[[str, BaseException], None] = _ignore,
    ) -> None:
        """`on_error` receives each contained exception (phasescope.telemetry.errors.TelemetryErrors counts them)."""
        direct, batched = tuple(direct), tuple(batched)
        every = (*direct, *batched)
        self._started = tuple(observer.request_started for observer in every)
        self._first_token_now = tuple(observer.request_first_token for observer in direct)
        self._first_token_held = tuple(observer.request_first_token for observer in batched)
        # Called for every step of every request.
        self._tokens = tuple(observer.tokens_generated for observer in every)
        self._finished_now = tuple(observer.request_finished for observer in direct)
        self._finished_held = tuple(observer.request_finished for observer in batched)
        self._rejected = tuple(observer.request_rejected for observer in every)
        self._pipeline = pipeline
        self._on_error = on_error

    def _deliver(self, calls: tuple[Callable[[*Args], None], ...], *args: *Args) -> None:
        """Each call with `args`; one that raises goes to `on_error` and costs that observer only."""
        for call in calls:
            try:
                call(*args)
            except Exception as exc:
                self._on_error("observer", exc)

    def _record(self, now: tuple[Callable[[R], None], ...], held: tuple[Callable[[R], None], ...], record: R) -> None:
        self._deliver(now, record)
        if self._pipeline is None:
            self._deliver(held, record)
        elif held:
            self._pipeline.hold(self._deliver, held, record)

    def request_started(self, model: str, adapter: str = BASE_ADAPTER) -> None:
        self._deliver(self._started, model, adapter)

    def request_first_token(self, record: FirstTokenRecord) -> None:
        self._record(self._first_token_now, self._first_token_held, record)

    def tokens_generated(self, model: str, count: int, adapter: str = BASE_ADAPTER) -> None:
        for count_tokens in self._tokens:
            try:
                count_tokens(model, count, adapter)
            except Exception as exc:
                self._on_error("observer", exc)

    def request_finished(self, record: PhaseRecord) -> None:
        self._record(self._finished_now, self._finished_held, record)

    def request_rejected(self, model: str, reason: str, adapter: str = BASE_ADAPTER) -> None:
        self._deliver(self._rejected, model, reason, adapter)
