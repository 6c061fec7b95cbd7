"""The exceptions phasescope raises on purpose, whichever protocol a request came in by.

`phasescope.serve.status` maps each to a gRPC status code; this module knows no transport.

    PhasescopeError
    ├── FieldError               about one field of the request: its message starts with the field
    │   ├── InvalidRequestError  the caller's fault: INVALID_ARGUMENT
    │   ├── NotConfiguredError   asks for what this worker was not started with: FAILED_PRECONDITION
    │   ├── NotFoundError        names something this worker does not have (an adapter): NOT_FOUND
    │   └── AlreadyExistsError   would add what this worker has already (an adapter's name): ALREADY_EXISTS
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


class FieldError(PhasescopeError):
    """An error about one field of a request: its message starts with the field's name."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class InvalidRequestError(FieldError):
    """A request the server will never serve as sent."""


class NotConfiguredError(FieldError):
    """A request that needs what this worker was not started with (e.g. a KV transfer without a KV connector):
    well formed, but for another worker, or for this one started otherwise."""


class NotFoundError(FieldError):
    """A request that names something this worker does not serve (a LoRA adapter it has not loaded)."""


class AlreadyExistsError(FieldError):
    """A call that would add what this worker already has (an adapter under a name that is served)."""


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
