"""The server's exceptions and the one table that maps them to gRPC status codes.

    PhasescopeError
    ├── InvalidRequestError      the caller's fault: INVALID_ARGUMENT, names the field
    ├── OverloadedError          too many requests admitted: RESOURCE_EXHAUSTED
    │   └── ClientLimitError     too many from this one caller: RESOURCE_EXHAUSTED
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


class NotReadyError(PhasescopeError):
    """The server cannot take requests now (starting or draining); retry elsewhere or later."""


class EngineUnavailableError(PhasescopeError):
    """The engine has died; the server cannot serve until it is restarted."""


# Ordered: the first matching row wins.
_STATUS_TABLE: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (OverloadedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (NotReadyError, grpc.StatusCode.UNAVAILABLE),
    (EngineUnavailableError, grpc.StatusCode.UNAVAILABLE),
    (asyncio.CancelledError, grpc.StatusCode.CANCELLED),
    # A stream closed while suspended at `yield` (the client cancelled between chunks).
    (GeneratorExit, grpc.StatusCode.CANCELLED),
)


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status code a request that raised `exc` ends with."""
    for kind, code in _STATUS_TABLE:
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL


def rejection_reason(exc: BaseException) -> str | None:
    """The `reason` label of `phasescope_requests_rejected_total`, or None if `exc` is no rejection."""
    if isinstance(exc, InvalidRequestError):
        return "invalid_argument"
    if isinstance(exc, ClientLimitError):
        return "client_limit"
    if isinstance(exc, OverloadedError):
        return "overloaded"
    if isinstance(exc, NotReadyError):
        return "not_ready"
    if isinstance(exc, EngineUnavailableError):
        return "engine_unavailable"
    return None
