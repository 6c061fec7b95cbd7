"""Telemetry that fails must never fail a request, and must not flood the log.

vLLM propagates an exception raised inside a stat logger (or its scheduler) to
every request in flight, and a broken observer would do the same to its request. So each
boundary where telemetry code runs on the request or step path catches what
it raises, counts it in `phasescope_telemetry_errors_total{component}` and
logs it at most once a minute per kind.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

from prometheus_client import Counter
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

LOG_INTERVAL_SECONDS = 60.0

_lock = threading.Lock()
_last_logged: dict[str, float] = {}
_suppressed: dict[str, int] = {}


def log_rate_limited(
    log: logging.Logger,
    key: str,
    message: str,
    *args: object,
    exc_info: BaseException | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> bool:
    """Log a warning at most once per `LOG_INTERVAL_SECONDS` per key; returns whether it was logged."""
    now = clock()
    with _lock:
        last = _last_logged.get(key)
        if last is not None and now - last < LOG_INTERVAL_SECONDS:
            _suppressed[key] = _suppressed.get(key, 0) + 1
            return False
        _last_logged[key] = now
        suppressed = _suppressed.pop(key, 0)
    if suppressed:
        message += f" ({suppressed} more since the last report)"
    log.warning(message, *args, exc_info=exc_info)
    return True


class TelemetryErrors(Collector):
    """Counts and reports exceptions raised by telemetry code, per component: a collector whoever wires it
    registers (phasescope.serve.build)."""

    def __init__(self, model: str) -> None:
        self._model = model
        self._logger = logging.getLogger("telemetry")
        self.errors = Counter(
            "phasescope_telemetry_errors",
            "Exceptions raised inside telemetry code and contained there (no request failed for them), "
            "per component: step = the engine's per-step stats, observer = a per-request observer.",
            ["model", "component"],
            registry=None,
        )
        for component in ("step", "observer"):
            self.errors.labels(model, component)

    def describe(self) -> Iterable[Metric]:
        return self.errors.describe()

    def collect(self) -> Iterable[Metric]:
        return self.errors.collect()

    def __call__(self, component: str, exc: BaseException) -> None:
        """Record one contained exception; never raises."""
        try:
            self.errors.labels(self._model, component).inc()
            log_rate_limited(
                self._logger,
                f"telemetry:{component}:{type(exc).__name__}",
                "telemetry error in %s contained (requests unaffected): %r",
                component,
                exc,
                exc_info=exc,
            )
        except Exception:  # the last line of defence: counting must not raise either
            pass
