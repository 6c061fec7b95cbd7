"""Transport concerns as gRPC interceptors, listed where the server is built (`phasescope.serve.build`)."""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import grpc

from phasescope.serve.status import status_for

logger = logging.getLogger(__name__)

# grpc's stubs type handler behaviours as synchronous; under grpc.aio they are
# coroutines and async generators, so these aliases say what they really are.
_Context = grpc.aio.ServicerContext[Any, Any]
_UnaryBehaviour = Callable[[Any, _Context], Awaitable[Any]]
_StreamBehaviour = Callable[[Any, _Context], AsyncGenerator[Any, None]]


async def _abort_with_status(context: _Context, exc: Exception) -> None:
    """Turn an exception into the RPC's status via the one table in phasescope.serve.status."""
    code = status_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        logger.error("internal error while serving a request", exc_info=exc)
        details = f"internal error ({type(exc).__name__}); the server logged the details"
    else:
        details = str(exc)
    await context.abort(code, details)


class ExceptionToStatusInterceptor(grpc.aio.ServerInterceptor):
    """Every exception a handler raises ends its RPC with the mapped status; the server keeps serving.

    Only the services named in `services` are wrapped: the standard health and reflection services map
    their own errors. gRPC's own errors (`grpc.aio.BaseError`: the handler's abort, a write to a call
    already over, a server stopping) go on to gRPC as they are, and so does a cancellation (no Exception).

    A stream's wrapper writes each message to gRPC itself (`context.write`) and yields none, so no
    message crosses a second generator on its way out: gRPC, and any interceptor around this one that
    iterates a stream (OpenTelemetry's server span), take a single step for the whole call. A coroutine,
    grpc.aio's other form of a stream handler, would fail under such an interceptor.
    """

    def __init__(self, services: tuple[str, ...]) -> None:
        self._prefixes = tuple(f"/{service}/" for service in services)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(self._prefixes):
            return handler
        if handler.unary_unary is not None:
            return with_behaviour(handler, _map_unary(handler.unary_unary))
        if handler.unary_stream is not None:
            return with_behaviour(handler, _map_stream(handler.unary_stream))
        return handler


def with_behaviour(handler: grpc.RpcMethodHandler[Any, Any], behaviour: Any) -> grpc.RpcMethodHandler[Any, Any]:
    """A handler of the same kind and (de)serialisers as `handler` that runs `behaviour` instead."""
    make: Any = grpc.unary_unary_rpc_method_handler
    if handler.unary_stream is not None:
        make = grpc.unary_stream_rpc_method_handler
    elif handler.stream_stream is not None:
        make = grpc.stream_stream_rpc_method_handler
    elif handler.stream_unary is not None:
        make = grpc.stream_unary_rpc_method_handler
    new: grpc.RpcMethodHandler[Any, Any] = make(
        behaviour, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
    )
    return new


def _map_unary(behaviour: Any) -> _UnaryBehaviour:
    unary: _UnaryBehaviour = behaviour

    async def mapped(request: Any, context: _Context) -> Any:
        try:
            return await unary(request, context)
        except grpc.aio.BaseError:
            raise
        except Exception as exc:
            await _abort_with_status(context, exc)

    return mapped


def _map_stream(behaviour: Any) -> _StreamBehaviour:
    stream: _StreamBehaviour = behaviour

    async def mapped(request: Any, context: _Context) -> AsyncGenerator[Any, None]:
        responses = stream(request, context)
        write = context.write  # looked up once: the context may be a proxy (the tracing span's)
        try:
            async for response in responses:
                await write(response)
        except grpc.aio.BaseError:
            raise
        except Exception as exc:
            await _abort_with_status(context, exc)
        finally:
            # Also when cancelled while a write waits: the handler's own cleanup runs now.
            await responses.aclose()
        return
        yield  # an async generator that yields nothing: every message went out through `context.write`

    return mapped
