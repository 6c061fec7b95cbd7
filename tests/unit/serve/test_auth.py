"""Bearer-token checks on a real in-process gRPC server (no engine needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest

from phasescope.serve.auth import BearerTokenInterceptor, caller_identity, load_tokens, token_matches

SERVICE = "test.Secret"
OPEN = "test.Open"


async def echo(request: bytes, context: Any) -> bytes:
    return request


async def call(metadata: tuple[tuple[str, str], ...] | None, service: str = SERVICE) -> bytes | grpc.StatusCode:
    server = grpc.aio.server(interceptors=[BearerTokenInterceptor((b"s3cret", b"other"), exempt=(OPEN,))])
    for name in (SERVICE, OPEN):
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(name, {"Echo": grpc.unary_unary_rpc_method_handler(echo)}),)
        )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            try:
                echo_call: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(f"/{service}/Echo")
                result: bytes = await echo_call(b"hi", metadata=metadata)
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
async def test_calls_need_a_known_bearer_token(metadata: tuple[tuple[str, str], ...] | None, expected: object) -> None:
    assert await call(metadata) == expected


async def test_exempt_services_stay_open() -> None:
    assert await call(None, service=OPEN) == b"hi"


def test_tokens_come_from_file_and_environment(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text("# operators\nalpha\n\n beta \n")
    assert load_tokens(str(path), "gamma, delta,") == (b"alpha", b"beta", b"gamma", b"delta")
    assert load_tokens("", "") == ()


def test_token_comparison() -> None:
    assert token_matches(b"beta", (b"alpha", b"beta"))
    assert not token_matches(b"bet", (b"alpha", b"beta"))
    assert not token_matches(b"", (b"alpha",))


class FakeContext:
    """The three things caller_identity reads from a grpc.aio ServicerContext."""

    def __init__(self, metadata: tuple[tuple[str, str], ...], common_names: list[bytes], peer: str) -> None:
        self._metadata, self._names, self._peer = metadata, common_names, peer

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def auth_context(self) -> dict[str, list[bytes]]:
        return {"x509_common_name": self._names} if self._names else {}

    def peer(self) -> str:
        return self._peer


def test_a_checked_token_names_the_caller_without_keeping_the_token() -> None:
    one = caller_identity(
        FakeContext((("authorization", "Bearer s3cret"),), [], "ipv4:10.0.0.1:5000"), tokens_checked=True
    )
    two = caller_identity(
        FakeContext((("authorization", "Bearer other"),), [], "ipv4:10.0.0.1:5000"), tokens_checked=True
    )
    assert one.startswith("token:")
    assert "s3cret" not in one
    assert one != two


def test_an_unchecked_token_cannot_choose_the_identity() -> None:
    context = FakeContext((("authorization", "Bearer made-up"),), [], "ipv4:10.0.0.1:5000")
    assert caller_identity(context, tokens_checked=False) == "address:ipv4:10.0.0.1"


@pytest.mark.parametrize(
    ("peer", "identity"),
    [
        ("ipv4:127.0.0.1:50512", "address:ipv4:127.0.0.1"),
        ("ipv6:[::1]:50512", "address:ipv6:[::1]"),
        ("unix:/run/phasescope.sock", "address:unix:/run/phasescope.sock"),
    ],
)
def test_without_token_or_certificate_the_address_without_its_port_names_the_caller(peer: str, identity: str) -> None:
    # Every connection of one host is one caller: opening more connections gains nothing.
    assert caller_identity(FakeContext((), [], peer), tokens_checked=False) == identity


def test_a_client_certificate_names_the_caller() -> None:
    context = FakeContext((), [b"team-a"], "ipv4:10.0.0.1:5000")
    assert caller_identity(context, tokens_checked=False) == "certificate:team-a"
