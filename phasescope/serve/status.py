"""The one table that maps phasescope's exceptions (`phasescope.errors`) to gRPC status codes."""

from __future__ import annotations

import asyncio

import grpc

from phasescope.errors import (
    AlreadyExistsError,
    ClientLimitError,
    EngineUnavailableError,
    InvalidRequestError,
    NotConfiguredError,
    NotFoundError,
    NotOfferedError,
    NotReadyError,
    OverloadedError,
    WatcherLimitError,
)

# The one table: what each exception becomes on the wire, and the `reason` label it is
# counted under in `phasescope_requests_rejected_total` when it refuses a request before
# the engine (None: not a refusal). Ordered most specific first; the first match wins.
_TABLE: tuple[tuple[type[BaseException], grpc.StatusCode, str | None], ...] = (
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument"),
    # Served by a worker started otherwise (e.g. KV-transfer parameters without --kv-transfer-config).
    (NotConfiguredError, grpc.StatusCode.FAILED_PRECONDITION, "not_configured"),
    # Names what the worker does not serve (a LoRA adapter it has not loaded).
    (NotFoundError, grpc.StatusCode.NOT_FOUND, "not_found"),
    # Only LoadAdapter raises it: no generation request is refused with it.
    (AlreadyExistsError, grpc.StatusCode.ALREADY_EXISTS, None),
    (ClientLimitError, grpc.StatusCode.RESOURCE_EXHAUSTED, "client_limit"),
    (OverloadedError, grpc.StatusCode.RESOURCE_EXHAUSTED, "overloaded"),
    # A watcher is no request: refusing one is not counted as a rejected request.
    (WatcherLimitError, grpc.StatusCode.RESOURCE_EXHAUSTED, None),
    (NotReadyError, grpc.StatusCode.UNAVAILABLE, "not_ready"),
    (EngineUnavailableError, grpc.StatusCode.UNAVAILABLE, "engine_unavailable"),
    # An RPC the worker does not offer is no refused request either.
    (NotOfferedError, grpc.StatusCode.UNIMPLEMENTED, None),
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
