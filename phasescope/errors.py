"""The exceptions phasescope raises on purpose, whichever protocol a request came in by.

`phasescope.serve.status` maps each to a gRPC status code; this module knows no transport.

    PhasescopeError
    ├── InvalidRequestError      the caller's fault: INVALID_ARGUMENT, names the field
    ├── NotConfiguredError       asks for what this worker was not started with: FAILED_PRECONDITION, names the field
    ├── OverloadedError          too many requests admitted: RESOURCE_EXHAUSTED
    │   └── ClientLimitError     too many from this one caller: RESOURCE_EXHAUSTED
    ├── WatcherLimitError        --max-watchers telemetry watchers already: RESOURCE_EXHAUSTED
    ├── NotReadyError            engine still starting, or the server draining: UNAVAILABLE
    ├── EngineUnavailableError   the engine died: UNAVAILABLE
    └── NotOfferedError          an RPC of a served protocol this worker does not offer: UNIMPLEMENTED

`asyncio.CancelledError` or `GeneratorExit` (client went away or its deadline
passed) is CANCELLED (the servicer's record says DEADLINE_EXCEEDED when the
deadline had passed); anything else is INTERNAL and logged with its traceback.
"""

from __future__ import annotations


class PhasescopeError(Exception):
    """Base of every error the server turns into a gRPC status on purpose."""


class InvalidRequestError(PhasescopeError):
    """A request the server will never serve as sent."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class NotConfiguredError(PhasescopeError):
    """A request that needs what this worker was not started with (e.g. a KV transfer without a KV connector):
    well formed, but for another worker, or for this one started otherwise."""

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


class NotOfferedError(PhasescopeError):
    """An RPC of a protocol the server speaks that this worker does not offer (e.g. Embed on a
    generation model)."""
