"""The interface between the request path and where its figures are sent.

The request path calls these three methods and nothing else; Prometheus,
tracing and logging are implementations (the pattern of vLLM's
`StatLoggerBase`). Implementations must be cheap and must not raise.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Protocol

from telemetry.phases import PhaseRecord

logger = logging.getLogger(__name__)


class RequestObserver(Protocol):
    def request_started(self, model: str) -> None:
        """A request was admitted and is now in flight."""

    def request_finished(self, record: PhaseRecord) -> None:
        """An admitted request ended, successfully or not."""

    def request_rejected(self, model: str, reason: str) -> None:
        """A request was refused before it reached the engine."""


class ObserverGroup:
    """Fans every call out to several observers; one failing does not stop the others."""

    def __init__(self, observers: Iterable[RequestObserver]) -> None:
        self._observers = tuple(observers)

    def request_started(self, model: str) -> None:
        for observer in self._observers:
            try:
                observer.request_started(model)
            except Exception:
                logger.exception("observer %s failed in request_started", type(observer).__name__)

    def request_finished(self, record: PhaseRecord) -> None:
        for observer in self._observers:
            try:
                observer.request_finished(record)
            except Exception:
                logger.exception("observer %s failed in request_finished", type(observer).__name__)

    def request_rejected(self, model: str, reason: str) -> None:
        for observer in self._observers:
            try:
                observer.request_rejected(model, reason)
            except Exception:
                logger.exception("observer %s failed in request_rejected", type(observer).__name__)
