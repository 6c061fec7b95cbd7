import asyncio

import grpc
import pytest

from phasescope.errors import (
    ClientLimitError,
    EngineUnavailableError,
    InvalidRequestError,
    NotConfiguredError,
    NotFoundError,
    NotReadyError,
    OverloadedError,
)
from phasescope.serve.status import rejection_reason, status_for, table


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (InvalidRequestError("prompt", "must not be empty"), grpc.StatusCode.INVALID_ARGUMENT),
        (NotConfiguredError("kv_transfer_params", "no connector"), grpc.StatusCode.FAILED_PRECONDITION),
        (NotFoundError("adapter", "no adapter named 'sql'"), grpc.StatusCode.NOT_FOUND),
        (OverloadedError("full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (NotReadyError("starting"), grpc.StatusCode.UNAVAILABLE),
        (EngineUnavailableError("dead"), grpc.StatusCode.UNAVAILABLE),
        (asyncio.CancelledError(), grpc.StatusCode.CANCELLED),
        (GeneratorExit(), grpc.StatusCode.CANCELLED),
        (RuntimeError("bug"), grpc.StatusCode.INTERNAL),
        (ValueError("not ours"), grpc.StatusCode.INTERNAL),
    ],
)
def test_exception_maps_to_status(exc: BaseException, code: grpc.StatusCode) -> None:
    assert status_for(exc) is code


def test_invalid_request_message_starts_with_the_field() -> None:
    assert str(InvalidRequestError("sampling.top_p", "must be in (0, 1]")) == "sampling.top_p: must be in (0, 1]"


def test_only_refusals_count_as_rejections() -> None:
    assert rejection_reason(OverloadedError("x")) == "overloaded"
    assert rejection_reason(ClientLimitError("x")) == "client_limit"
    assert status_for(ClientLimitError("x")) is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert rejection_reason(InvalidRequestError("f", "m")) == "invalid_argument"
    assert rejection_reason(NotConfiguredError("f", "m")) == "not_configured"
    assert rejection_reason(NotFoundError("f", "m")) == "not_found"
    assert rejection_reason(NotReadyError("x")) == "not_ready"
    assert rejection_reason(RuntimeError("x")) is None


def test_the_table_lists_every_subclass_before_its_base() -> None:
    # The first matching row wins: a base listed first would swallow its subclass's row
    # (ClientLimitError would be counted as "overloaded").
    kinds = [kind for kind, _, _ in table()]
    for index, kind in enumerate(kinds):
        assert not any(issubclass(kind, earlier) for earlier in kinds[:index]), kind
