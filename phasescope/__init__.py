"""phasescope: an inference server over vLLM that shows where each request's time goes.

The public surface is the client side; the server runs as `phasescope serve`.

    from phasescope import Client, build_request

    with Client("127.0.0.1:50051") as client:
        for chunk in client.generate_stream(build_request(chat=[("user", "Hi")], max_tokens=32)):
            print(chunk.text, end="")

The rooms (one folder each, drawn in CONTRIBUTING.md): `v1` (the generated contract),
`serve` (the process and its protocol handlers), `engine` (the engine interface and its
vLLM implementation), `telemetry` (requests, steps, hardware, models; no transport),
`client` (the clients and `top`'s view), `cli` (the command line) and `bench`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from phasescope.client.client import AsyncClient, Client, Credentials, build_request, tokenize_request
    from phasescope.errors import (
        ClientLimitError,
        EngineUnavailableError,
        InvalidRequestError,
        NotReadyError,
        OverloadedError,
        PhasescopeError,
        WatcherLimitError,
    )

# Resolved on first use (PEP 562), so importing any room (the server, its engine processes,
# the telemetry) does not pay for the client's gRPC stubs.
_HOMES = {
    "AsyncClient": "phasescope.client.client",
    "Client": "phasescope.client.client",
    "Credentials": "phasescope.client.client",
    "build_request": "phasescope.client.client",
    "tokenize_request": "phasescope.client.client",
    "ClientLimitError": "phasescope.errors",
    "EngineUnavailableError": "phasescope.errors",
    "InvalidRequestError": "phasescope.errors",
    "NotReadyError": "phasescope.errors",
    "OverloadedError": "phasescope.errors",
    "PhasescopeError": "phasescope.errors",
    "WatcherLimitError": "phasescope.errors",
}


def __getattr__(name: str) -> object:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'phasescope' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)


__all__ = [
    "AsyncClient",
    "Client",
    "ClientLimitError",
    "Credentials",
    "EngineUnavailableError",
    "InvalidRequestError",
    "NotReadyError",
    "OverloadedError",
    "PhasescopeError",
    "WatcherLimitError",
    "build_request",
    "tokenize_request",
]
