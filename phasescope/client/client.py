"""A small typed client for phasescope, synchronous and asyncio, over the generated stubs.

with Client("127.0.0.1:50051") as client:
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
    token_ids_only: bool = False,
    stream_interval: int = 0,
    adapter: str = "",
    **sampling: Any,
) -> pb.GenerateRequest:
    """A GenerateRequest from plain values; `sampling` takes SamplingParams' field names."""
    request = pb.GenerateRequest(
        request_id=request_id,
        sampling=pb.SamplingParams(**sampling),
        token_ids_only=token_ids_only,
        stream_interval=stream_interval,
        adapter=adapter,
    )
    if prompt is not None:
        request.prompt = prompt
    if chat is not None:
        request.chat.messages.extend(pb.ChatMessage(role=role, content=content) for role, content in chat)
    if token_ids is not None:
        request.token_ids.ids.extend(token_ids)
    return request


def tokenize_request(text: str | None = None, chat: Sequence[tuple[str, str]] | None = None) -> pb.TokenizeRequest:
    request = pb.TokenizeRequest()
    if text is not None:
        request.text = text
    if chat is not None:
        request.chat.messages.extend(pb.ChatMessage(role=role, content=content) for role, content in chat)
    return request


def _status_name(response: Any) -> str:
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))


class _Client:
    """What the blocking and the asyncio client share: every request, its deadline and metadata.

    The two subclasses differ only in their channel and in awaiting, so a call's
    credentials, tracing and deadline cannot drift between them.
    """

    def __init__(self, channel: Any, timeout_seconds: float | None, credentials: Credentials | None) -> None:
        self._channel = channel
        self._credentials = credentials
        self._timeout = timeout_seconds
        self._stub = pb_grpc.InferenceStub(channel)
        # The health stubs declare no methods on HealthStub; calls go through Any.
        self._health: Any = health_pb2_grpc.HealthStub(channel)

    def _options(self, traceparent: str | None = None, deadline_seconds: float | None = None) -> dict[str, Any]:
        """A call's deadline (this call's, else the client's) and metadata (trace context, bearer token)."""
        return {
            "timeout": deadline_seconds if deadline_seconds is not None else self._timeout,
            "metadata": _metadata(traceparent, self._credentials),
        }


class Client(_Client):
    """Blocking client; use as a context manager or call close()."""

    def __init__(
        self, address: str, *, timeout_seconds: float | None = None, credentials: Credentials | None = None
    ) -> None:
        if credentials is not None and credentials.secure:
            channel = grpc.secure_channel(address, credentials.channel_credentials(), options=_CHANNEL_OPTIONS)
        else:
            channel = grpc.insecure_channel(address, options=_CHANNEL_OPTIONS)
        super().__init__(channel, timeout_seconds, credentials)

    def generate(
        self, request: pb.GenerateRequest, *, traceparent: str | None = None, deadline_seconds: float | None = None
    ) -> pb.GenerateResponse:
        response: pb.GenerateResponse = self._stub.Generate(request, **self._options(traceparent, deadline_seconds))
        return response

    def generate_stream(
        self, request: pb.GenerateRequest, *, traceparent: str | None = None, deadline_seconds: float | None = None
    ) -> Iterator[pb.GenerateStreamResponse]:
        """Chunks as the engine produces them; cancel() the returned iterator to stop early.

        `traceparent` (see `new_traceparent`) makes the server's spans part of the caller's trace.
        """
        chunks: Iterator[pb.GenerateStreamResponse] = self._stub.GenerateStream(
            request, **self._options(traceparent, deadline_seconds)
        )
        return chunks

    def tokenize(self, text: str | None = None, chat: Sequence[tuple[str, str]] | None = None) -> list[int]:
        return list(self._stub.Tokenize(tokenize_request(text, chat), **self._options()).token_ids)

    def watch_telemetry(self, request: pb.WatchTelemetryRequest | None = None) -> Iterator[pb.TelemetrySnapshot]:
        """Snapshots every interval until cancel() on the returned iterator (no deadline unless the client has one)."""
        snapshots: Iterator[pb.TelemetrySnapshot] = self._stub.WatchTelemetry(
            request or pb.WatchTelemetryRequest(), **self._options()
        )
        return snapshots

    def model_info(self) -> pb.ModelInfo:
        info: pb.ModelInfo = self._stub.GetModelInfo(pb.GetModelInfoRequest(), **self._options())
        return info

    def list_adapters(self) -> list[pb.AdapterInfo]:
        response: pb.ListAdaptersResponse = self._stub.ListAdapters(pb.ListAdaptersRequest(), **self._options())
        return list(response.adapters)

    def load_adapter(self, name: str, path: str) -> pb.AdapterInfo:
        info: pb.AdapterInfo = self._stub.LoadAdapter(pb.LoadAdapterRequest(name=name, path=path), **self._options())
        return info

    def unload_adapter(self, name: str) -> pb.AdapterInfo:
        info: pb.AdapterInfo = self._stub.UnloadAdapter(pb.UnloadAdapterRequest(name=name), **self._options())
        return info

    def health(self, service: str = "") -> str:
        """ "SERVING", "NOT_SERVING", ... as the standard health service reports it."""
        return _status_name(self._health.Check(health_pb2.HealthCheckRequest(service=service), **self._options()))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()


class AsyncClient(_Client):
    """asyncio client; use as an async context manager or await close()."""

    def __init__(
        self, address: str, *, timeout_seconds: float | None = None, credentials: Credentials | None = None
    ) -> None:
        if credentials is not None and credentials.secure:
            channel = grpc.aio.secure_channel(address, credentials.channel_credentials(), options=_CHANNEL_OPTIONS)
        else:
            channel = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
        super().__init__(channel, timeout_seconds, credentials)

    async def generate(
        self, request: pb.GenerateRequest, *, traceparent: str | None = None, deadline_seconds: float | None = None
    ) -> pb.GenerateResponse:
        response: pb.GenerateResponse = await self._stub.Generate(
            request, **self._options(traceparent, deadline_seconds)
        )
        return response

    async def generate_stream(
        self, request: pb.GenerateRequest, *, traceparent: str | None = None, deadline_seconds: float | None = None
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        """Chunks as the engine produces them; close the generator (aclose) to cancel the call."""
        call: Any = self._stub.GenerateStream(request, **self._options(traceparent, deadline_seconds))
        try:
            async for chunk in call:
                yield chunk
        finally:
            call.cancel()

    async def watch_telemetry(
        self, request: pb.WatchTelemetryRequest | None = None
    ) -> AsyncIterator[pb.TelemetrySnapshot]:
        """Snapshots every interval; close the generator (aclose) to cancel the call."""
        call: Any = self._stub.WatchTelemetry(request or pb.WatchTelemetryRequest(), **self._options())
        try:
            async for snapshot in call:
                yield snapshot
        finally:
            call.cancel()

    async def tokenize(self, text: str | None = None, chat: Sequence[tuple[str, str]] | None = None) -> list[int]:
        response: pb.TokenizeResponse = await self._stub.Tokenize(tokenize_request(text, chat), **self._options())
        return list(response.token_ids)

    async def model_info(self) -> pb.ModelInfo:
        info: pb.ModelInfo = await self._stub.GetModelInfo(pb.GetModelInfoRequest(), **self._options())
        return info

    async def list_adapters(self) -> list[pb.AdapterInfo]:
        response: pb.ListAdaptersResponse = await self._stub.ListAdapters(pb.ListAdaptersRequest(), **self._options())
        return list(response.adapters)

    async def load_adapter(self, name: str, path: str) -> pb.AdapterInfo:
        request = pb.LoadAdapterRequest(name=name, path=path)
        info: pb.AdapterInfo = await self._stub.LoadAdapter(request, **self._options())
        return info

    async def unload_adapter(self, name: str) -> pb.AdapterInfo:
        info: pb.AdapterInfo = await self._stub.UnloadAdapter(pb.UnloadAdapterRequest(name=name), **self._options())
        return info

    async def health(self, service: str = "") -> str:
        """ "SERVING", "NOT_SERVING", ... as the standard health service reports it."""
        return _status_name(await self._health.Check(health_pb2.HealthCheckRequest(service=service), **self._options()))

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        await self.close()
