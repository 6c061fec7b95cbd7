"""The exception-to-status interceptor on a real in-process gRPC server (no engine needed)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import grpc
import pytest

from phasescope.errors import InvalidRequestError, OverloadedError
from phasescope.serve.interceptors import ExceptionToStatusInterceptor, StatusOnError, maps_own_errors

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


@maps_own_errors
async def own_stream(request: bytes, context: Any) -> AsyncGenerator[bytes, None]:
    async with StatusOnError(context):
        yield b"first"
        if request == b"overload":
            raise OverloadedError("full")
        if request == b"bug":
            raise RuntimeError("secret internals")
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
                    "OwnStream": grpc.unary_stream_rpc_method_handler(own_stream),
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


async def call_stream(channel: grpc.aio.Channel, payload: bytes, name: str = "Stream") -> list[bytes]:
    method: grpc.aio.UnaryStreamMultiCallable[bytes, bytes] = channel.unary_stream(f"/{SERVICE}/{name}")
    return [chunk async for chunk in method(payload)]


async def test_known_errors_get_their_status_and_message() -> None:
    async def scenario() -> grpc.aio.AioRpcError:
        async with served() as channel:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call_unary(channel, b"invalid")
            return caught.value

    error = await scenario()
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == "prompt: must not be empty"


async def test_unexpected_errors_are_internal_without_leaking_details(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> tuple[grpc.aio.AioRpcError, bytes]:
        async with served() as channel:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call_unary(channel, b"bug")
            # The server keeps serving.
            return caught.value, await call_unary(channel, b"fine")

    error, after = await scenario()
    assert error.code() is grpc.StatusCode.INTERNAL
    assert "secret" not in (error.details() or "")
    assert "RuntimeError" in (error.details() or "")
    assert after == b"fine"
    # The traceback goes to the log instead.
    assert any(record.exc_info and "secret internals" in str(record.exc_info[1]) for record in caplog.records)


async def test_stream_error_after_chunks_ends_the_stream_with_the_status() -> None:
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

    chunks, error, after = await scenario()
    assert chunks == [b"first"]
    assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert after == [b"first", b"second"]


async def test_a_stream_mapping_its_own_errors_is_left_unwrapped_and_ends_with_the_same_statuses() -> None:
    async def scenario() -> tuple[grpc.RpcMethodHandler[Any, Any] | None, list[grpc.aio.AioRpcError], list[bytes]]:
        handler: grpc.RpcMethodHandler[Any, Any] = grpc.unary_stream_rpc_method_handler(own_stream)

        async def continuation(details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any]:
            return handler

        details: Any = type("Details", (), {"method": f"/{SERVICE}/OwnStream", "invocation_metadata": ()})()
        seen = await ExceptionToStatusInterceptor((SERVICE,)).intercept_service(continuation, details)
        errors = []
        async with served() as channel:
            for payload in (b"overload", b"bug"):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await call_stream(channel, payload, "OwnStream")
                errors.append(caught.value)
            return (seen if seen is handler else None), errors, await call_stream(channel, b"ok", "OwnStream")

    unwrapped, (overloaded, bug), after = await scenario()
    # The interceptor hands the handler back as it is: no wrapper generator between its messages and gRPC.
    assert unwrapped is not None
    assert overloaded.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert bug.code() is grpc.StatusCode.INTERNAL
    assert "secret" not in (bug.details() or "")
    assert after == [b"first", b"second"]
