"""Bearer-token checks on a real in-process gRPC server (no engine needed)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest

from server.auth import BearerTokenInterceptor, load_tokens, token_matches

SERVICE = "test.Secret"
OPEN = "test.Open"


async def echo(request: bytes, context: Any) -> bytes:
    return request


async def call(metadata: tuple[tuple[str, str], ...] | None, service: str = SERVICE) -> bytes | grpc.StatusCode:
    server = grpc.aio.server(interceptors=[BearerTokenInterceptor((b"s3cret", b"other"), exempt=(OPEN,))])
    for name in (SERVICE, OPEN):
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(name, {"Echo": grpc.unary_unary_rpc_method_handler(echo)}),)  # type: ignore[arg-type]  # aio handler
        )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            try:
                result: bytes = await channel.unary_unary(f"/{service}/Echo")(b"hi", metadata=metadata)
                return result
            except grpc.aio.AioRpcError as exc:
                return exc.code()
    finally:
        await server.stop(None)


@pytest.mark.parametrize(
    ("metadata", "expected"),
    [
        (None, grpc.StatusCode.UNAUTHENTICATED),
        ((("authorization", "Basic abc"),), grpc.StatusCode.UNAUTHENTICATED),
        ((("authorization", "Bearer wrong"),), grpc.StatusCode.PERMISSION_DENIED),
        ((("authorization", "Bearer s3cret"),), b"hi"),
        ((("authorization", "bearer other"),), b"hi"),
    ],
)
def test_calls_need_a_known_bearer_token(metadata: tuple[tuple[str, str], ...] | None, expected: object) -> None:
    assert asyncio.run(call(metadata)) == expected


def test_exempt_services_stay_open() -> None:
    assert asyncio.run(call(None, service=OPEN)) == b"hi"


def test_tokens_come_from_file_and_environment(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text("# operators\nalpha\n\n beta \n")
    assert load_tokens(str(path), "gamma, delta,") == (b"alpha", b"beta", b"gamma", b"delta")
    assert load_tokens("", "") == ()


def test_token_comparison() -> None:
    assert token_matches(b"beta", (b"alpha", b"beta"))
    assert not token_matches(b"bet", (b"alpha", b"beta"))
    assert not token_matches(b"", (b"alpha",))
