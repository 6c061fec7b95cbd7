"""A small typed client for phasescope, synchronous and asyncio, over the generated stubs.

with PhasescopeClient("127.0.0.1:50051") as client:
    for chunk in client.generate_stream(build_request(chat=[("user", "Hi")], max_tokens=32)):
        print(chunk.text, end="")
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from phasescope.v1 import inference_pb2 as pb
from phasescope.v1 import inference_pb2_grpc as pb_grpc

_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 16 * 2**20)]


def new_traceparent() -> tuple[str, str]:
    """A fresh sampled W3C `traceparent` and its trace id, so a request can be found in the traces."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id


@dataclass(frozen=True)
class Credentials:
    """How to reach a server with TLS, mutual TLS and/or a bearer token."""

    root_certificates: bytes | None = None
    """PEM CA that signed the server's certificate; None for a plaintext channel."""
    client_key: bytes | None = None
    """PEM key and certificate chain of this client, for mutual TLS."""
    client_certificate_chain: bytes | None = None
    token: str | None = None
    """Sent as `authorization: Bearer <token>`."""

    @property
    def secure(self) -> bool:
        return self.root_certificates is not None

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.root_certificates, self.client_key, self.client_certificate_chain)


def _metadata(traceparent: str | None, credentials: Credentials | None = None) -> tuple[tuple[str, str], ...] | None:
    entries: list[tuple[str, str]] = []
    if traceparent:
        entries.append(("traceparent", traceparent))
    if credentials is not None and credentials.token:
        entries.append(("authorization", f"Bearer {credentials.token}"))
    return tuple(entries) or None


def build_request(
    *,
    prompt: str | None = None,
    chat: Sequence[tuple[str, str]] | None = None,
    token_ids: Sequence[int] | None = None,
    request_id: str = "",
    **sampling: Any,
) -> pb.GenerateRequest:
    """A GenerateRequest from plain values; `sampling` takes SamplingParams' field names."""
    request = pb.GenerateRequest(request_id=request_id, sampling=pb.SamplingParams(**sampling))
    if prompt is not None:
        request.prompt = prompt
    if chat is not None:
        request.chat.messages.extend(pb.ChatMessage(role=role, content=content) for role, content in chat)
    if token_ids is not None:
        request.token_ids.ids.extend(token_ids)
    return request


class PhasescopeClient:
    """Blocking client; use as a context manager or call close()."""

    def __init__(
        self, address: str, *, timeout_seconds: float | None = None, credentials: Credentials | None = None
    ) -> None:
        self._credentials = credentials
        if credentials is not None and credentials.secure:
            self._channel = grpc.secure_channel(address, credentials.channel_credentials(), options=_CHANNEL_OPTIONS)
        else:
            self._channel = grpc.insecure_channel(address, options=_CHANNEL_OPTIONS)
        self._stub = pb_grpc.InferenceStub(self._channel)
        # The health stubs declare no methods on HealthStub; calls go through Any.
        self._health: Any = health_pb2_grpc.HealthStub(self._channel)
        self._timeout = timeout_seconds

    def generate(self, request: pb.GenerateRequest, *, traceparent: str | None = None) -> pb.GenerateResponse:
        return self._stub.Generate(request, timeout=self._timeout, metadata=_metadata(traceparent, self._credentials))

    def generate_stream(
        self, request: pb.GenerateRequest, *, traceparent: str | None = None
    ) -> Iterator[pb.GenerateStreamResponse]:
        """Chunks as the engine produces them; cancel() the returned iterator to stop early.

        `traceparent` (see `new_traceparent`) makes the server's spans part of the caller's trace.
        """
        return self._stub.GenerateStream(
            request, timeout=self._timeout, metadata=_metadata(traceparent, self._credentials)
        )

    def tokenize(self, text: str | None = None, chat: Sequence[tuple[str, str]] | None = None) -> list[int]:
        request = pb.TokenizeRequest()
        if text is not None:
            request.text = text
        if chat is not None:
            request.chat.messages.extend(pb.ChatMessage(role=role, content=content) for role, content in chat)
        return list(
            self._stub.Tokenize(request, timeout=self._timeout, metadata=_metadata(None, self._credentials)).token_ids
        )

    def model_info(self) -> pb.ModelInfo:
        return self._stub.GetModelInfo(
            pb.GetModelInfoRequest(), timeout=self._timeout, metadata=_metadata(None, self._credentials)
        )

    def health(self, service: str = "") -> str:
        """ "SERVING", "NOT_SERVING", ... as the standard health service reports it."""
        response = self._health.Check(
            health_pb2.HealthCheckRequest(service=service),
            timeout=self._timeout,
            metadata=_metadata(None, self._credentials),
        )
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> PhasescopeClient:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()


class AsyncPhasescopeClient:
    """asyncio client; use as an async context manager or await close()."""

    def __init__(
        self, address: str, *, timeout_seconds: float | None = None, credentials: Credentials | None = None
    ) -> None:
        self._credentials = credentials
        if credentials is not None and credentials.secure:
            channel_credentials = credentials.channel_credentials()
            self._channel = grpc.aio.secure_channel(address, channel_credentials, options=_CHANNEL_OPTIONS)
        else:
            self._channel = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
        self._stub = pb_grpc.InferenceStub(self._channel)
        # The health stubs declare no methods on HealthStub; calls go through Any.
        self._health: Any = health_pb2_grpc.HealthStub(self._channel)
        self._timeout = timeout_seconds

    async def generate(self, request: pb.GenerateRequest, *, traceparent: str | None = None) -> pb.GenerateResponse:
        response: pb.GenerateResponse = await self._stub.Generate(
            request, timeout=self._timeout, metadata=_metadata(traceparent, self._credentials)
        )
        return response

    async def generate_stream(
        self, request: pb.GenerateRequest, *, traceparent: str | None = None
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        call: Any = self._stub.GenerateStream(
            request, timeout=self._timeout, metadata=_metadata(traceparent, self._credentials)
        )
        try:
            async for chunk in call:
                yield chunk
        finally:
            call.cancel()

    async def model_info(self) -> pb.ModelInfo:
        info: pb.ModelInfo = await self._stub.GetModelInfo(
            pb.GetModelInfoRequest(), timeout=self._timeout, metadata=_metadata(None, self._credentials)
        )
        return info

    async def health(self, service: str = "") -> str:
        response: Any = await self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=self._timeout)
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncPhasescopeClient:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        await self.close()
