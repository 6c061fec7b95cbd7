"""`front_end_what_if`'s cuts: the names it refuses, and the engine core's bounded blocking wait."""

from __future__ import annotations

import sys
import time

import pytest
import zmq
from vllm.distributed.device_communicators import shm_broadcast

from loadtests import front_end_what_if


def test_an_unknown_cut_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PHASESCOPE_WHAT_IF", "no-engine-mfu,no-such-cut")
    with pytest.raises(SystemExit, match="unknown no-such-cut"):
        front_end_what_if.apply_cuts()


def test_engine_core_blocks_changes_nothing_in_the_server_process(monkeypatch: pytest.MonkeyPatch) -> None:
    wait = shm_broadcast.SpinCondition.wait
    monkeypatch.setenv("PHASESCOPE_WHAT_IF", "engine-core-blocks")
    front_end_what_if.apply_cuts()
    assert shm_broadcast.SpinCondition.wait is wait


def test_a_blocked_reader_wakes_on_its_notification_and_never_waits_long_without_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(shm_broadcast.SpinCondition, "wait", shm_broadcast.SpinCondition.wait)
    front_end_what_if._engine_core_blocks()
    context = zmq.Context()
    try:
        writer = shm_broadcast.SpinCondition(False, context, "inproc://what-if-notify")
        reader = shm_broadcast.SpinCondition(True, context, "inproc://what-if-notify")
        reader.last_read = float("-inf")  # long idle: vLLM's own wait would block for the caller's whole timeout
        time.sleep(0.05)  # the subscription reaches the publisher
        # No notification (one lost, say): back within the 1 ms bound, not after the caller's timeout.
        start = time.monotonic()
        reader.wait(timeout_ms=5_000)
        assert time.monotonic() - start < 0.5
        # A notification is taken, so the next wait does not return on it again at once.
        writer.notify()  # type: ignore[no-untyped-call]  # vLLM leaves it unannotated
        time.sleep(0.05)
        reader.wait(timeout_ms=5_000)
        assert reader.local_notify_socket.poll(0) == 0
    finally:
        context.destroy(linger=0)


def test_switch_1ms_shortens_the_interpreters_switch_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    before = sys.getswitchinterval()
    monkeypatch.setenv("PHASESCOPE_WHAT_IF", "switch-1ms")
    try:
        front_end_what_if.apply_cuts()
        assert sys.getswitchinterval() == pytest.approx(0.001)
    finally:
        sys.setswitchinterval(before)
