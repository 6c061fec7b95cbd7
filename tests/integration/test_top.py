"""`phasescope top` against the real server: the full-screen view in a real terminal (tmux), `--once`,
and a `--record`ed stream replayed with no server."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from phasescope.client.client import build_request
from support.servers import ROOT, ServerProcess

TOP = [sys.executable, "-m", "phasescope", "top"]
WAIT_SECONDS = 30.0

Tmux = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def tmux(tmp_path: Path) -> Iterator[Tmux]:
    """A private tmux server (its own socket): the tests neither see nor touch the user's sessions.

    It runs in the foreground (-D) as our child rather than daemonising, so it is ended by its pid,
    and it works where the daemon cannot start (a /dev/null that is not a device).
    """
    assert shutil.which("tmux") is not None, "tmux is needed for this test (make setup installs it)"
    socket = f"phasescope-top-test-{os.getpid()}"
    config = tmp_path / "tmux.conf"
    config.write_text("")
    server = subprocess.Popen(["tmux", "-L", socket, "-f", str(config), "-D"], stdin=subprocess.DEVNULL)

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["tmux", "-L", socket, *args], capture_output=True, text=True, timeout=10)

    try:
        # Until our server answers: a command that starts no server of its own (`start-server` would start a
        # daemon when ours is still coming up, and the two then fight over the socket).
        deadline = time.monotonic() + 10
        while run("show-options", "-g").returncode != 0 and time.monotonic() < deadline:
            assert server.poll() is None, "the tmux server exited"
            time.sleep(0.1)
        yield run
    finally:
        run("kill-server")
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def wait_for(screen: Callable[[], str], ready: Callable[[str], bool], seconds: float = WAIT_SECONDS) -> str:
    deadline = time.monotonic() + seconds
    text = screen()
    while not ready(text) and time.monotonic() < deadline:
        time.sleep(0.25)
        text = screen()
    return text


def lines_starting(text: str, prefix: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(prefix)]


def test_live_view_shows_header_engine_and_request_rows_and_quits_on_q(
    server: ServerProcess, tmux: Tmux, tmp_path: Path
) -> None:
    status_file = tmp_path / "status"
    top = " ".join([*TOP, "--address", server.address, "--interval", "0.5"])
    session = "top"
    assert tmux("new-session", "-d", "-s", session, "-x", "160", "-y", "50", "-c", str(ROOT),
                f"{top}; echo $? > {status_file}").returncode == 0  # fmt: skip
    request_id = "top-live-1"
    with server.client() as client:
        stream = client.generate_stream(
            build_request(prompt="Count to a thousand:", max_tokens=400, ignore_eos=True, request_id=request_id)
        )

        def drain() -> None:
            # The stream ends with CANCELLED when the test cancels it.
            with contextlib.suppress(grpc.RpcError):
                for _ in stream:
                    pass

        reader = threading.Thread(target=drain, daemon=True)
        reader.start()
        try:
            text = wait_for(
                lambda: tmux("capture-pane", "-p", "-t", session).stdout,
                lambda t: "phasescope top ·" in t and bool(lines_starting(t, "decode ")) and request_id in t,
            )
        finally:
            stream.cancel()  # type: ignore[attr-defined]  # the call object is also a grpc.Future
            reader.join(timeout=10)
    assert "phasescope top ·" in text, text
    assert "peaks " in text
    assert "admission in flight" in text
    assert "engine 0" in text
    (decode,) = lines_starting(text, "decode ")
    assert any(verdict in decode.split() for verdict in ("memory", "compute", "host", "idle")), decode
    (row,) = [line for line in text.splitlines() if line.startswith(request_id)]
    assert row.split()[1] in ("prefill", "decode"), row
    assert tmux("send-keys", "-t", session, "q").returncode == 0
    deadline = time.monotonic() + 10
    while tmux("has-session", "-t", session).returncode == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert tmux("has-session", "-t", session).returncode != 0, "q did not end phasescope top"
    assert status_file.read_text().strip() == "0"


def run_top(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*TOP, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_once_prints_one_plain_frame_with_the_header_and_engine_rows(server: ServerProcess) -> None:
    result = run_top("--address", server.address, "--once", "--width", "100")
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert text.startswith("phasescope top · ")
    assert "\x1b" not in text
    assert max(len(line) for line in text.splitlines()) <= 100
    assert lines_starting(text, "peaks ")
    assert lines_starting(text, "engine 0")
    assert [line.split()[0] for line in text.splitlines() if line.split()[:1] in (["prefill"], ["decode"])] == [
        "prefill",
        "decode",
    ]


def test_a_recorded_stream_replays_without_a_server(server: ServerProcess, tmp_path: Path) -> None:
    recording = tmp_path / "top.jsonl"
    live = run_top("--address", server.address, "--once", "--record", str(recording))
    assert live.returncode == 0, live.stderr
    assert len(recording.read_text().splitlines()) == 1
    # Nothing listens on port 1: the replay reads only the file.
    replayed = run_top("--address", "127.0.0.1:1", "--replay", str(recording), "--once")
    assert replayed.returncode == 0, replayed.stderr
    assert replayed.stdout == live.stdout
