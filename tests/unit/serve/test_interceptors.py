"""The exception-to-status interceptor on a real in-process gRPC server (no engine needed)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import grpc
import pytest

from phasescope.errors import InvalidRequestError, OverloadedError
from phasescope.serve.interceptors import ExceptionToStatusInterceptor

SERVICE = "test.Echo"


async def unary(request: bytes, context: Any) -> bytes:
    if request == b"invalid":
        raise InvalidRequestError("prompt", "must not be empty")
    if request == b"bug":
        raise RuntimeError("secret internals")
    return request


async def stream(request: bytes, context: Any) -> AsyncGenerator[bytes, None]:
    yield b"first"
    if request == b"overload":
        raise OverloadedError("full")
    yield b"second"


async def start_server() -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server(interceptors=[ExceptionToStatusInterceptor((SERVICE,))])
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                SERVICE,
                {
                    "Unary": grpc.unary_unary_rpc_method_handler(unary),
                    "Stream": grpc.unary_stream_rpc_method_handler(stream),
                },
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


@contextlib.asynccontextmanager
async def served() -> AsyncIterator[grpc.aio.Channel]:
    server, address = await start_server()
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            yield channel
    finally:
        await server.stop(None)


async def call_unary(channel: grpc.aio.Channel, payload: bytes) -> bytes:
    method: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(f"/{SERVICE}/Unary")
    result: bytes = await method(payload)
    return result


async def call_stream(channel: grpc.aio.Channel, payload: bytes) -> list[bytes]:
    method: grpc.aio.UnaryStreamMultiCallable[bytes, bytes] = channel.unary_stream(f"/{SERVICE}/Stream")
    return [chunk async for chunk in method(payload)]


def test_known_errors_get_their_status_and_message() -> None:
    async def scenario() -> grpc.aio.AioRpcError:
        async with served() as channel:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call_unary(channel, b"invalid")
            return caught.value

    error = asyncio.run(scenario())
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == "prompt: must not be empty"


def test_unexpected_errors_are_internal_without_leaking_details(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> tuple[grpc.aio.AioRpcError, bytes]:
        async with served() as channel:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call_unary(channel, b"bug")
            # The server keeps serving.
            return caught.value, await call_unary(channel, b"fine")

    error, after = asyncio.run(scenario())
    assert error.code() is grpc.StatusCode.INTERNAL
    assert "secret" not in (error.details() or "")
    assert "RuntimeError" in (error.details() or "")
    assert after == b"fine"
    # The traceback goes to the log instead.
    assert any(record.exc_info and "secret internals" in str(record.exc_info[1]) for record in caplog.records)


def test_stream_error_after_chunks_ends_the_stream_with_the_status() -> None:
    async def scenario() -> tuple[list[bytes], grpc.aio.AioRpcError, list[bytes]]:
        async with served() as channel:
            chunks: list[bytes] = []

            async def read() -> None:
                method: grpc.aio.UnaryStreamMultiCallable[bytes, bytes] = channel.unary_stream(f"/{SERVICE}/Stream")
                async for chunk in method(b"overload"):
                    chunks.append(chunk)

            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await read()
            return chunks, caught.value, await call_stream(channel, b"ok")

    chunks, error, after = asyncio.run(scenario())
    assert chunks == [b"first"]
    assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert after == [b"first", b"second"]
