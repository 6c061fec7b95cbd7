"""vLLM's engine protocol (VllmEngine) for tests: its stub, on a channel of its own or on one a test holds."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import grpc
from smg_grpc_proto.generated import vllm_engine_pb2_grpc


def engine_stub_on(channel: grpc.Channel | grpc.aio.Channel) -> Any:
    """vLLM's engine protocol on `channel` (untyped: its grpc module has no stubs)."""
    return vllm_engine_pb2_grpc.VllmEngineStub(channel)  # type: ignore[no-untyped-call]  # its grpc module has no stubs


@contextmanager
def open_engine_stub(address: str) -> Iterator[Any]:
    """vLLM's engine protocol on an insecure channel to `address`, closed on leaving."""
    with grpc.insecure_channel(address) as channel:
        yield engine_stub_on(channel)
