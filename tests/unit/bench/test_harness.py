import gzip
import json
import os
import socket
import sys
import time
from pathlib import Path

import psutil
import pytest

from phasescope.bench.harness import (
    ManagedProcess,
    StartError,
    ephemeral_ports,
    free_port,
    health_status,
    write_results,
)

# A parent that starts a child in its own process group, prints the child's pid, and sleeps.
PARENT_WITH_CHILD = (
    "import subprocess, sys, time; "
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
    "print(child.pid, flush=True); time.sleep(60)"
)


def ends(pid: int, timeout: float = 10.0) -> bool:
    """Whether the process ends in time (a zombie waiting for an init that may not reap it counts as ended)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def child_pid(process: ManagedProcess) -> int:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        text = process.log_path.read_text().strip()
        if text:
            return int(text)
        time.sleep(0.05)
    raise TimeoutError(process.log_tail())


def test_stop_ends_the_whole_process_group(tmp_path: Path) -> None:
    process = ManagedProcess([sys.executable, "-c", PARENT_WITH_CHILD], tmp_path / "log")
    child = child_pid(process)
    process.stop(timeout=10)
    # The child outlived its parent's SIGTERM; the group's SIGKILL ended it.
    assert ends(child)
    assert process.stop() == process.process.returncode  # a second stop leaves it as it is


# Counts the SIGTERMs it gets (a line each) and exits a moment after the first, as a draining server does.
COUNTS_SIGTERMS = (
    "import signal, sys, time\n"
    "def count(signum, frame):\n"
    "    print('SIGTERM', flush=True)\n"
    "signal.signal(signal.SIGTERM, count)\n"
    "print('ready', flush=True)\n"
    "while 'SIGTERM' not in open(sys.argv[1]).read():\n"
    "    time.sleep(0.01)\n"
    "time.sleep(0.5)\n"
)


def test_processes_told_to_terminate_first_drain_side_by_side_and_each_is_signalled_once(tmp_path: Path) -> None:
    logs = [tmp_path / f"log{index}" for index in range(2)]
    processes = [ManagedProcess([sys.executable, "-c", COUNTS_SIGTERMS, str(log)], log) for log in logs]
    for process in processes:
        while "ready" not in process.log_path.read_text():
            time.sleep(0.01)
    started = time.monotonic()
    for process in processes:
        process.terminate()
        process.terminate()
    for process in processes:
        assert process.stop(timeout=10) == 0
    # Both drained at once (0.5 s each), and neither got a second SIGTERM from terminate or stop.
    assert time.monotonic() - started < 0.95
    assert [log.read_text().count("SIGTERM") for log in logs] == [1, 1]


def test_a_managed_process_has_its_own_group_but_shares_the_callers_session(tmp_path: Path) -> None:
    # Its own process group, so stop() can end the whole tree; the caller's session, so the kernel's
    # autogroup scheduler does not give a server and its engine a CPU share of their own against the
    # benchmark's client (the cause of stalled streams at 16 streams, docs/benchmarks.md).
    process = ManagedProcess([sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "log")
    try:
        assert os.getpgid(process.process.pid) == process.process.pid != os.getpgid(0)
        assert os.getsid(process.process.pid) == os.getsid(0)
    finally:
        process.stop(timeout=10)


def test_a_process_that_exits_during_start_up_is_reported_with_its_log(tmp_path: Path) -> None:
    process = ManagedProcess([sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "log")
    with pytest.raises(StartError, match=r"probe exited with 3; see .*log"):
        process.wait_until(lambda: False, "probe", poll_seconds=0.05)


def test_a_start_that_is_never_ready_stops_the_group(tmp_path: Path) -> None:
    process = ManagedProcess([sys.executable, "-c", PARENT_WITH_CHILD], tmp_path / "log")
    child = child_pid(process)
    with pytest.raises(StartError, match="probe not ready after 0 s"):
        process.wait_until(lambda: False, "probe", timeout=0.3, poll_seconds=0.05)
    assert process.process.poll() is not None
    assert ends(child)


def test_a_ready_check_that_raises_counts_as_not_ready(tmp_path: Path) -> None:
    checks: list[int] = []

    def ready() -> bool:
        checks.append(1)
        if len(checks) < 3:
            raise ConnectionRefusedError
        return True

    with ManagedProcess([sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "log") as process:
        process.wait_until(ready, "probe", timeout=30, poll_seconds=0.01)
    assert len(checks) == 3
    assert process.process.poll() is not None


def test_health_of_a_port_where_nothing_listens_is_unreachable() -> None:
    assert health_status(f"127.0.0.1:{free_port()}") == "UNREACHABLE"


RESULTS = {"points": [{"value": 4, "ttft_ms": [1.5, 2.25]}], "command": "phasescope bench", "note": "µs"}


def test_results_named_gz_are_gzip_with_no_name_or_time_and_read_back_equal(tmp_path: Path) -> None:
    path = tmp_path / "study" / "day" / "results.json.gz"  # folders that do not exist yet
    write_results(path, RESULTS)
    raw = path.read_bytes()
    assert raw[:3] == b"\x1f\x8b\x08"  # gzip, deflate
    assert not raw[3] & 0x08, "a file name in the header"
    assert raw[4:8] == bytes(4), "a time in the header"
    assert json.loads(gzip.decompress(raw)) == RESULTS


def test_the_same_results_make_the_same_bytes_whatever_the_file_is_called(tmp_path: Path) -> None:
    write_results(tmp_path / "first.json.gz", RESULTS)
    write_results(tmp_path / "second.json.gz", RESULTS)
    assert (tmp_path / "first.json.gz").read_bytes() == (tmp_path / "second.json.gz").read_bytes()


def test_results_named_json_are_plain_json(tmp_path: Path) -> None:
    path = tmp_path / "new" / "results.json"
    write_results(path, RESULTS, indent=2)
    text = path.read_text(encoding="utf-8")
    assert json.loads(text) == RESULTS
    assert text == json.dumps(RESULTS, indent=2) + "\n"


def test_a_free_port_is_bindable_and_outside_the_range_outgoing_connections_take_theirs_from() -> None:
    low, high = ephemeral_ports()
    for _ in range(20):
        port = free_port()
        assert not low <= port <= high
        with socket.socket() as server:
            server.bind(("127.0.0.1", port))
