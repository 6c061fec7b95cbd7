"""The exception-to-status interceptor on a real in-process gRPC server (no engine needed)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

import grpc
import pytest
from opentelemetry.instrumentation.grpc import aio_server_interceptor
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode as SpanStatus

from phasescope.errors import InvalidRequestError, OverloadedError
from phasescope.serve.auth import BearerTokenInterceptor
from phasescope.serve.interceptors import ExceptionToStatusInterceptor

SERVICE = "test.Echo"
OTHER = "test.Unmapped"
BIG = b"x" * 2**16  # a few of these fill the connection's flow-control window: the next write waits


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
    if request == b"invalid":
        raise InvalidRequestError("sampling.top_p", "must be in (0, 1]")
    if request == b"bug":
        raise RuntimeError("secret internals")
    if request == b"abort":
        await context.abort(grpc.StatusCode.NOT_FOUND, "no such thing")
    yield b"second"


class Parked:
    """A stream the test cancels: where its handler was when it stopped, and when it had cleaned up."""

    def __init__(self) -> None:
        self.sent = 0
        self.flooding = asyncio.Event()
        self.ended_by: type[BaseException] | None = None
        self.closed = asyncio.Event()

    async def stream(self, request: bytes, context: Any) -> AsyncGenerator[bytes, None]:
        try:
            if request == b"wait":  # cancelled inside the handler, while it awaits
                yield b"first"
                await asyncio.Event().wait()
            while True:  # cancelled while a write waits for the client, the handler parked at `yield`
                self.sent += 1
                if self.sent == 64:
                    self.flooding.set()
                yield BIG
        except BaseException as exc:
            self.ended_by = type(exc)
            raise
        finally:
            self.closed.set()


def handlers(parked: Parked) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Unary": grpc.unary_unary_rpc_method_handler(unary),
            "Stream": grpc.unary_stream_rpc_method_handler(stream),
            "Parked": grpc.unary_stream_rpc_method_handler(parked.stream),
        },
    )


@contextlib.asynccontextmanager
async def served(
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (), parked: Parked | None = None
) -> AsyncIterator[grpc.aio.Channel]:
    server = grpc.aio.server(interceptors=[*interceptors, ExceptionToStatusInterceptor((SERVICE,))])
    server.add_generic_rpc_handlers((handlers(parked or Parked()),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel
    finally:
        await server.stop(None)


async def call_unary(channel: grpc.aio.Channel, payload: bytes) -> bytes:
    method: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(f"/{SERVICE}/Unary")
    result: bytes = await method(payload)
    return result


Ended = tuple[list[bytes], grpc.StatusCode, str]


async def read_stream(
    channel: grpc.aio.Channel, payload: bytes, metadata: tuple[tuple[str, str], ...] | None = None
) -> Ended:
    """The messages a stream delivered, then the status it ended with and its details."""
    method: grpc.aio.UnaryStreamMultiCallable[bytes, bytes] = channel.unary_stream(f"/{SERVICE}/Stream")
    chunks: list[bytes] = []
    try:
        async for chunk in method(payload, metadata=metadata):
            chunks.append(chunk)
    except grpc.aio.AioRpcError as error:
        return chunks, error.code(), error.details() or ""
    return chunks, grpc.StatusCode.OK, ""


def interceptor_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == "phasescope.serve.interceptors"]


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


PAYLOADS = (b"overload", b"invalid", b"bug", b"ok")


async def test_a_stream_that_fails_delivers_what_it_sent_then_the_mapped_status(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def scenario() -> dict[bytes, Ended]:
        async with served() as channel:
            return {payload: await read_stream(channel, payload) for payload in PAYLOADS}

    ends = await scenario()
    assert ends[b"overload"] == ([b"first"], grpc.StatusCode.RESOURCE_EXHAUSTED, "full")
    assert ends[b"invalid"] == ([b"first"], grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_p: must be in (0, 1]")
    chunks, code, details = ends[b"bug"]
    assert (chunks, code) == ([b"first"], grpc.StatusCode.INTERNAL)
    assert "RuntimeError" in details
    assert "secret" not in details
    assert any(record.exc_info and "secret internals" in str(record.exc_info[1]) for record in caplog.records)
    # The server kept serving.
    assert ends[b"ok"] == ([b"first", b"second"], grpc.StatusCode.OK, "")


async def test_a_handlers_own_abort_reaches_the_client_as_it_is(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> Ended:
        async with served() as channel:
            return await read_stream(channel, b"abort")

    assert await scenario() == ([b"first"], grpc.StatusCode.NOT_FOUND, "no such thing")
    assert interceptor_errors(caplog) == []


@pytest.mark.parametrize(
    ("payload", "ended_by"),
    [(b"wait", asyncio.CancelledError), (b"flood", GeneratorExit)],
    ids=["awaiting", "parked-at-yield"],
)
async def test_a_cancelled_stream_frees_its_handler_at_once_and_is_not_mapped(
    payload: bytes, ended_by: type[BaseException], caplog: pytest.LogCaptureFixture
) -> None:
    parked = Parked()

    async def scenario() -> None:
        async with served(parked=parked) as channel:
            method: grpc.aio.UnaryStreamMultiCallable[bytes, bytes] = channel.unary_stream(f"/{SERVICE}/Parked")
            call = method(payload)
            await call.read()
            if payload == b"flood":
                # Until the window is full and a write waits for this client, which reads no more.
                await asyncio.wait_for(parked.flooding.wait(), 5)
            call.cancel()
            await asyncio.wait_for(parked.closed.wait(), 5)

    await scenario()
    assert parked.ended_by is ended_by
    assert interceptor_errors(caplog) == []


async def test_servers_built_as_build_py_lists_them_keep_auth_and_give_the_span_the_final_status() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    auth = BearerTokenInterceptor((b"s3cret",), exempt=())
    tracing = aio_server_interceptor(tracer_provider=provider)  # type: ignore[no-untyped-call]
    token = (("authorization", "Bearer s3cret"),)

    async def scenario() -> dict[bytes, Ended]:
        async with served((auth, tracing)) as channel:
            ends = {payload: await read_stream(channel, payload, token) for payload in (b"ok", b"overload", b"bug")}
            ends[b"no token"] = await read_stream(channel, b"ok")
            return ends

    ends = await scenario()
    assert ends[b"ok"] == ([b"first", b"second"], grpc.StatusCode.OK, "")
    assert ends[b"overload"] == ([b"first"], grpc.StatusCode.RESOURCE_EXHAUSTED, "full")
    assert ends[b"no token"][:2] == ([], grpc.StatusCode.UNAUTHENTICATED)
    spans: tuple[ReadableSpan, ...] = exporter.get_finished_spans()
    # One server span for each call the tokens let through, with the status the client saw.
    codes = [(span.attributes or {}).get("rpc.grpc.status_code") for span in spans]
    assert codes == [
        grpc.StatusCode.OK.value[0],
        grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
        grpc.StatusCode.INTERNAL.value[0],
    ]
    assert spans[2].status.status_code is SpanStatus.ERROR


async def test_other_services_are_left_as_they_are() -> None:
    handler: grpc.RpcMethodHandler[Any, Any] = grpc.unary_stream_rpc_method_handler(stream)

    async def continuation(details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any]:
        return handler

    details: Any = type("Details", (), {"method": f"/{OTHER}/Stream", "invocation_metadata": ()})()
    assert await ExceptionToStatusInterceptor((SERVICE,)).intercept_service(continuation, details) is handler


async def test_a_wrapped_stream_writes_each_message_itself_and_yields_none() -> None:
    # What keeps a streamed message from crossing a second generator: gRPC (or a tracing span around the
    # wrapper) iterates a generator that yields nothing, and the handler's messages go straight to `write`.
    handler: grpc.RpcMethodHandler[Any, Any] = grpc.unary_stream_rpc_method_handler(stream)

    async def continuation(details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any]:
        return handler

    class Context:
        def __init__(self) -> None:
            self.written: list[bytes] = []

        async def write(self, message: bytes) -> None:
            self.written.append(message)

    details: Any = type("Details", (), {"method": f"/{SERVICE}/Stream", "invocation_metadata": ()})()
    wrapped = await ExceptionToStatusInterceptor((SERVICE,)).intercept_service(continuation, details)
    assert wrapped is not None
    # grpc's stubs type behaviours as synchronous; this one is an async generator function.
    behaviour: Any = wrapped.unary_stream
    context = Context()
    yielded = [message async for message in behaviour(b"ok", context)]
    assert yielded == []
    assert context.written == [b"first", b"second"]
