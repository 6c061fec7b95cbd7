"""Admission control: total capacity first, then what one caller may hold."""

from __future__ import annotations

import pytest

from phasescope.errors import ClientLimitError, OverloadedError
from phasescope.serve.inference import Admission


def test_beyond_running_plus_queued_is_overloaded() -> None:
    admission = Admission(max_running=1, max_queued=1)
    admission.acquire("a")
    admission.acquire("a")  # no per-client limit: one caller may fill the server
    with pytest.raises(OverloadedError, match="2 requests in flight"):
        admission.acquire("b")
    admission.release("a")
    admission.acquire("b")
    assert admission.in_flight == 2


def test_one_caller_cannot_take_more_than_its_share() -> None:
    admission = Admission(max_running=4, max_queued=4, per_client=2)
    admission.acquire("a")
    admission.acquire("a")
    with pytest.raises(ClientLimitError, match=r"at its limit of 2 requests in flight \(--max-requests-per-client\)"):
        admission.acquire("a")
    # Others are still served, and the refused request holds nothing.
    admission.acquire("b")
    assert admission.in_flight == 3
    admission.release("a")
    admission.acquire("a")
    assert admission.in_flight == 3


def test_the_server_limit_is_reported_before_the_callers() -> None:
    admission = Admission(max_running=1, max_queued=0, per_client=1)
    admission.acquire("a")
    with pytest.raises(OverloadedError) as caught:
        admission.acquire("a")
    assert not isinstance(caught.value, ClientLimitError)


def test_callers_leave_no_trace_once_their_requests_end() -> None:
    admission = Admission(max_running=8, max_queued=0, per_client=1)
    for index in range(100):
        admission.acquire(f"caller-{index % 4}")
        admission.release(f"caller-{index % 4}")
    assert admission.in_flight == 0
    assert admission._by_client == {}
