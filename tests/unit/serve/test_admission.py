"""Admission control: total capacity first, then what one caller may hold; a permit always goes back."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack

import pytest

from phasescope.errors import ClientLimitError, OverloadedError
from phasescope.serve.admission import Admission


async def test_beyond_running_plus_queued_is_overloaded() -> None:
    admission = Admission(max_running=1, max_queued=1)
    async with AsyncExitStack() as held:
        await held.enter_async_context(admission.permit("a"))
        second = await held.enter_async_context(AsyncExitStack())
        await second.enter_async_context(admission.permit("a"))  # no per-client limit: one caller may fill it
        with pytest.raises(OverloadedError, match="2 requests in flight"):
            await held.enter_async_context(admission.permit("b"))
        await second.aclose()
        await held.enter_async_context(admission.permit("b"))
        assert admission.in_flight == 2
    assert admission.in_flight == 0


async def test_one_caller_cannot_take_more_than_its_share() -> None:
    admission = Admission(max_running=4, max_queued=4, per_client=2)
    async with AsyncExitStack() as held:
        first = await held.enter_async_context(AsyncExitStack())
        await first.enter_async_context(admission.permit("a"))
        await held.enter_async_context(admission.permit("a"))
        with pytest.raises(
            ClientLimitError, match=r"at its limit of 2 requests in flight \(--max-requests-per-client\)"
        ):
            await held.enter_async_context(admission.permit("a"))
        # Others are still served, and the refused request holds nothing.
        await held.enter_async_context(admission.permit("b"))
        assert admission.in_flight == 3
        await first.aclose()
        await held.enter_async_context(admission.permit("a"))
        assert admission.in_flight == 3


async def test_the_server_limit_is_reported_before_the_callers() -> None:
    admission = Admission(max_running=1, max_queued=0, per_client=1)
    async with admission.permit("a"):
        with pytest.raises(OverloadedError) as caught:
            await admission.permit("a").__aenter__()
    assert not isinstance(caught.value, ClientLimitError)


async def test_a_permit_goes_back_when_its_request_fails_or_is_cancelled() -> None:
    admission = Admission(max_running=1, max_queued=0)
    with pytest.raises(RuntimeError):
        async with admission.permit("a"):
            raise RuntimeError("the request failed")
    entered = asyncio.Event()

    async def held_until_cancelled() -> None:
        async with admission.permit("a"):
            entered.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(held_until_cancelled())
    await entered.wait()
    assert admission.in_flight == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert admission.in_flight == 0
    await asyncio.wait_for(admission.wait_idle(), timeout=1.0)


async def test_callers_leave_no_trace_once_their_requests_end() -> None:
    admission = Admission(max_running=8, max_queued=0, per_client=1)
    for index in range(100):
        async with admission.permit(f"caller-{index % 4}"):
            pass
    assert admission.in_flight == 0
    assert admission._by_client == {}


async def test_without_a_per_client_limit_callers_are_not_told_apart() -> None:
    admission = Admission(max_running=2, max_queued=0)
    async with admission.permit("a"), admission.permit("b"):
        assert admission._by_client == {"": 2}
