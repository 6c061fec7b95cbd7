"""The server's exceptions and the one table that maps them to gRPC status codes.

    PhasescopeError
    ├── InvalidRequestError      the caller's fault: INVALID_ARGUMENT, names the field
    ├── OverloadedError          too many requests admitted: RESOURCE_EXHAUSTED
    │   └── ClientLimitError     too many from this one caller: RESOURCE_EXHAUSTED
    ├── WatcherLimitError        --max-watchers telemetry watchers already: RESOURCE_EXHAUSTED
    ├── NotReadyError            engine still starting, or the server draining: UNAVAILABLE
    └── EngineUnavailableError   the engine died: UNAVAILABLE

`asyncio.CancelledError` or `GeneratorExit` (client went away or its deadline
passed) is CANCELLED (the servicer's record says DEADLINE_EXCEEDED when the
deadline had passed); anything else is INTERNAL and logged with its traceback.
"""

from __future__ import annotations

import asyncio

import grpc


class PhasescopeError(Exception):
    """Base of every error the server turns into a gRPC status on purpose."""


class InvalidRequestError(PhasescopeError):
    """A request the server will never serve as sent."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class OverloadedError(PhasescopeError):
    """More requests are in flight than the server admits."""


class ClientLimitError(OverloadedError):
    """One caller already has as many requests in flight as it may (`--max-requests-per-client`)."""


class WatcherLimitError(PhasescopeError):
    """As many WatchTelemetry streams are open as the server allows (`--max-watchers`)."""


class NotReadyError(PhasescopeError):
    """The server cannot take requests now (starting or draining); retry elsewhere or later."""


class EngineUnavailableError(PhasescopeError):
    """The engine has died; the server cannot serve until it is restarted."""


# The one table: what each exception becomes on the wire, and the `reason` label it is
# counted under in `phasescope_requests_rejected_total` when it refuses a request before
# the engine (None: not a refusal). Ordered most specific first; the first match wins.
_TABLE: tuple[tuple[type[BaseException], grpc.StatusCode, str | None], ...] = (
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument"),
    (ClientLimitError, grpc.StatusCode.RESOURCE_EXHAUSTED, "client_limit"),
    (OverloadedError, grpc.StatusCode.RESOURCE_EXHAUSTED, "overloaded"),
    # A watcher is no request: refusing one is not counted as a rejected request.
    (WatcherLimitError, grpc.StatusCode.RESOURCE_EXHAUSTED, None),
    (NotReadyError, grpc.StatusCode.UNAVAILABLE, "not_ready"),
    (EngineUnavailableError, grpc.StatusCode.UNAVAILABLE, "engine_unavailable"),
    (asyncio.CancelledError, grpc.StatusCode.CANCELLED, None),
    # A stream closed while suspended at `yield` (the client cancelled between chunks).
    (GeneratorExit, grpc.StatusCode.CANCELLED, None),
)


def _row(exc: BaseException) -> tuple[grpc.StatusCode, str | None]:
    for kind, code, reason in _TABLE:
        if isinstance(exc, kind):
            return code, reason
    return grpc.StatusCode.INTERNAL, None


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status code a request that raised `exc` ends with."""
    return _row(exc)[0]


def rejection_reason(exc: BaseException) -> str | None:
    """The `reason` label of `phasescope_requests_rejected_total`, or None if `exc` is no rejection."""
    return _row(exc)[1]


def table() -> tuple[tuple[type[BaseException], grpc.StatusCode, str | None], ...]:
    """The rows, for tests that check the table's order."""
    return _TABLE
