"""Access control: bearer tokens checked by an interceptor, and TLS / mutual-TLS server credentials.

Tokens come from a file (one per line) or PHASESCOPE_AUTH_TOKENS (comma-separated)
and are compared in constant time. A call without a token is UNAUTHENTICATED;
one with a token the server does not know is PERMISSION_DENIED. The health and
reflection services can stay open for probes (`--auth-exempt-health`).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import grpc

from phasescope.serve.interceptors import with_behaviour

logger = logging.getLogger(__name__)

_Context = grpc.aio.ServicerContext[Any, Any]


def load_tokens(path: str, from_environment: str) -> tuple[bytes, ...]:
    """Tokens from the file (one per line, # comments) and the environment's comma-separated list."""
    tokens: list[str] = []
    if path:
        for line in Path(path).read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                tokens.append(line)
    tokens.extend(token.strip() for token in from_environment.split(",") if token.strip())
    return tuple(token.encode() for token in tokens)


def token_matches(candidate: bytes, tokens: Iterable[bytes]) -> bool:
    # Compare against every token, always: the time taken says nothing about which one matched.
    matched = False
    for token in tokens:
        matched |= hmac.compare_digest(candidate, token)
    return matched


def _authorization(metadata: Any) -> str | None:
    """The first `authorization` metadata value, decoded; None when the call has none."""
    for key, value in metadata or ():
        if key == "authorization":
            return value if isinstance(value, str) else str(value.decode(errors="replace"))
    return None


def _bearer_token(value: str) -> str:
    """The token of a `Bearer <token>` value, as sent; empty for any other scheme."""
    scheme, _, token = value.partition(" ")
    return token if scheme.lower() == "bearer" else ""


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without a known `authorization: Bearer <token>`, except to `exempt` services."""

    def __init__(self, tokens: tuple[bytes, ...], exempt: tuple[str, ...]) -> None:
        if not tokens:
            raise ValueError("bearer-token authentication needs at least one token")
        self._tokens = tokens
        self._exempt = tuple(f"/{service}/" for service in exempt)

    def _refusal(self, metadata: Any) -> tuple[grpc.StatusCode, str] | None:
        value = _authorization(metadata)
        if value is None:
            return grpc.StatusCode.UNAUTHENTICATED, "missing `authorization: Bearer <token>` metadata"
        token = _bearer_token(value)
        if not token:
            return grpc.StatusCode.UNAUTHENTICATED, "authorization metadata must be `Bearer <token>`"
        if not token_matches(token.strip().encode(), self._tokens):
            return grpc.StatusCode.PERMISSION_DENIED, "the token is not allowed to call this server"
        return None

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(self._exempt):
            return handler
        refusal = self._refusal(handler_call_details.invocation_metadata)
        if refusal is None:
            return handler
        code, details = refusal
        logger.debug("refused %s: %s", handler_call_details.method, code.name)

        async def refuse_unary(request: Any, context: _Context) -> Any:
            await context.abort(code, details)

        async def refuse_stream(request: Any, context: _Context) -> AsyncGenerator[Any, None]:
            await context.abort(code, details)
            yield  # pragma: no cover  # makes this an async generator, as the stream handler must be

        streaming = handler.unary_stream is not None or handler.stream_stream is not None
        return with_behaviour(handler, refuse_stream if streaming else refuse_unary)


def caller_identity(context: Any, *, tokens_checked: bool) -> str:
    """Who is calling, for per-caller limits: the bearer token when the server checks tokens
    (as a digest: the token itself is never kept), else the client certificate's common name
    (mutual TLS), else the peer's address without its port.

    An unchecked token would let a caller pick a fresh identity per request, so without
    token checking the certificate or the address decides.
    """
    if tokens_checked:
        token = _bearer_token(_authorization(context.invocation_metadata()) or "").strip()
        if token:
            return "token:" + hashlib.sha256(token.encode()).hexdigest()[:16]
    names = context.auth_context().get("x509_common_name")
    if names:
        return "certificate:" + str(names[0].decode(errors="replace"))
    peer = str(context.peer())  # "ipv4:127.0.0.1:50512", "ipv6:[::1]:50512", "unix:/path"
    host, colon, port = peer.rpartition(":")
    return "address:" + (host if colon and port.isdigit() else peer)


def server_credentials(cert_file: str, key_file: str, client_ca_file: str) -> grpc.ServerCredentials:
    """TLS with the server's certificate; with a client CA, mutual TLS that requires a client certificate."""
    root = Path(client_ca_file).read_bytes() if client_ca_file else None
    return grpc.ssl_server_credentials(
        [(Path(key_file).read_bytes(), Path(cert_file).read_bytes())],
        root_certificates=root,
        require_client_auth=root is not None,
    )
