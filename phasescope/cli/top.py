"""`phasescope top`: a live, full-screen view of the server's WatchTelemetry stream.

The frame is `phasescope.client.top_view`'s (rich: `Live` redraws it full-screen, a plain
console prints it for `--once`). This module runs what feeds it: a source
thread (the server's stream, reconnecting with backoff, or a recording played
back at its own pace) puts snapshots and connection states on a queue; the
main thread reads keys, drains the queue and redraws. rich reads no input, so
keys come from stdin in cbreak mode (stdlib termios/tty) polled with select:
no curses, and Ctrl-C still raises KeyboardInterrupt.

A recording (`--record`) is one snapshot per line, protobuf's JSON with the
proto field names, so `--replay` (and jq) reads it back.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TypeAlias, TypeVar, cast

from phasescope.cli.connection import add_client_parser, credentials

if TYPE_CHECKING:
    import grpc
    from rich.console import RenderableType

    from phasescope.cli import Subparsers
    from phasescope.client.client import Credentials
    from phasescope.client.top_view import TokenRateHistory
    from phasescope.v1 import inference_pb2 as pb

ONCE_TIMEOUT_SECONDS = 30.0
# Backoff after the server goes away: 1, 2, 4, ... up to this.
MAX_RECONNECT_SECONDS = 30.0
# The server's watcher cap is not lifted by hammering it.
WATCHER_CAP_RETRY_SECONDS = 15.0
KEY_POLL_SECONDS = 0.1


N = TypeVar("N", int, float)


def _bounded(kind: Callable[[str], N], low: N, high: N) -> Callable[[str], N]:
    """An argparse `type` that also checks the range (the server would answer INVALID_ARGUMENT)."""

    def parse(text: str) -> N:
        value = kind(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in [{low:g}, {high:g}], got {text}")
        return value

    return parse


def add_cli_args(subparsers: Subparsers) -> argparse.ArgumentParser:
    parser = add_client_parser(
        subparsers, "top", "a live view of every engine and request (keys: p pause, s sort, q quit)"
    )
    parser.add_argument(
        "--interval", type=_bounded(float, 0.25, 60.0), default=1.0, help="seconds between snapshots (default 1)"
    )
    parser.add_argument(
        "--max-requests", type=_bounded(int, 1, 1000), default=32, help="requests to list, 1 to 1000 (default 32)"
    )
    parser.add_argument(
        "--newest-first",
        action="store_true",
        help="list the newest requests when more than --max-requests are in flight, and put them first",
    )
    parser.add_argument("--once", action="store_true", help="print one frame as plain text and exit")
    parser.add_argument("--width", type=int, default=120, help="--once: the frame's width in columns (default 120)")
    parser.add_argument("--record", metavar="FILE", help="also write each snapshot to FILE, one JSON line each")
    parser.add_argument("--replay", metavar="FILE", help="play a --record file back instead of watching a server")
    parser.add_argument(
        "--replay-speed", type=_bounded(float, 0.01, 1000.0), default=1.0, help="--replay: times the recorded pace"
    )
    return parser


@dataclass(frozen=True)
class Waiting:
    """The source has no stream: why, and when it tries again (None: it will not)."""

    message: str
    retry_at_monotonic: float | None = None


@dataclass(frozen=True)
class Fatal:
    """The source gave up: the one line to print and the exit status."""

    message: str
    exit_code: int


Event: TypeAlias = "pb.TelemetrySnapshot | Waiting | Fatal"


def retry_after_seconds(code: grpc.StatusCode | None, attempt: int) -> float | None:
    """How long to wait before watching again after the stream ended with `code` (None: it ended cleanly).

    None: do not retry (the caller is refused, or the server has no WatchTelemetry).
    """
    import grpc

    refusals = (
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    if code in refusals:
        return None
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        return WATCHER_CAP_RETRY_SECONDS
    return float(min(2**attempt, MAX_RECONNECT_SECONDS))


def _exit_code(code: grpc.StatusCode | None) -> int:
    """2 when the caller is refused (credentials), 1 otherwise."""
    import grpc

    return 2 if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED) else 1


def _why(code: grpc.StatusCode | None, details: str | None) -> str:
    import grpc

    if code is None:
        return "the server ended the stream"
    if code is grpc.StatusCode.UNAVAILABLE:
        return "server unavailable"
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        return f"server refused: {details}"
    return f"{code.name}: {details}"


def _cancel(snapshots: Iterator[pb.TelemetrySnapshot]) -> None:
    """Ends a stream from any thread: the iterator a streaming stub returns is also its call."""
    cast("grpc.RpcContext", snapshots).cancel()


def watch_request(args: argparse.Namespace) -> pb.WatchTelemetryRequest:
    from phasescope.v1 import inference_pb2 as pb

    order = pb.REQUEST_ORDER_NEWEST_FIRST if args.newest_first else pb.REQUEST_ORDER_OLDEST_FIRST
    return pb.WatchTelemetryRequest(interval_seconds=args.interval, max_requests=args.max_requests, request_order=order)


class ServerSource:
    """Watches the server on a thread and reconnects when the stream ends, until `stop()` or a refusal."""

    def __init__(
        self, address: str, creds: Credentials, request: pb.WatchTelemetryRequest, events: queue.Queue[Event]
    ) -> None:
        self._address = address
        self._credentials = creds
        self._request = request
        self._events = events
        self._stopping = threading.Event()
        # Guards `_snapshots` against stop() cancelling before the thread stores a new stream.
        self._lock = threading.Lock()
        self._snapshots: Iterator[pb.TelemetrySnapshot] | None = None
        self._thread = threading.Thread(target=self._run, name="phasescope-top-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stopping.set()
            if self._snapshots is not None:
                _cancel(self._snapshots)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        import grpc

        from phasescope.client.client import Client

        attempt = 0
        while True:
            # A fresh channel each time: a channel that saw the server go away backs off on its own
            # (up to 2 minutes) and would fail our retries fast long after the server is back.
            with Client(self._address, credentials=self._credentials) as client:
                with self._lock:
                    if self._stopping.is_set():
                        return
                    self._snapshots = snapshots = client.watch_telemetry(self._request)
                code: grpc.StatusCode | None = None
                details: str | None = None
                try:
                    for snapshot in snapshots:
                        attempt = 0
                        self._events.put(snapshot)
                except grpc.RpcError as exc:
                    if self._stopping.is_set():
                        return
                    code, details = exc.code(), exc.details()
            delay = retry_after_seconds(code, attempt)
            if delay is None:
                self._events.put(Fatal(f"phasescope top: {_why(code, details)}", _exit_code(code)))
                return
            attempt += 1
            self._events.put(Waiting(_why(code, details), time.monotonic() + delay))
            if self._stopping.wait(delay):
                return


def read_recording(path: Path) -> Iterator[pb.TelemetrySnapshot]:
    """The snapshots of a `--record` file, in order; ValueError names the line that is not one."""
    from google.protobuf import json_format

    from phasescope.v1 import inference_pb2 as pb

    with path.open() as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                yield json_format.Parse(line, pb.TelemetrySnapshot())
            except json_format.ParseError as exc:
                raise ValueError(f"{path}:{number}: not a TelemetrySnapshot: {exc}") from exc


def recording_line(snapshot: pb.TelemetrySnapshot) -> str:
    from google.protobuf import json_format

    return json_format.MessageToJson(snapshot, indent=None, preserving_proto_field_name=True) + "\n"


class ReplaySource:
    """Plays a recording back on a thread, waiting between snapshots as long as their timestamps say (÷ speed)."""

    def __init__(self, path: Path, speed: float, events: queue.Queue[Event]) -> None:
        self._path = path
        self._speed = speed
        self._events = events
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="phasescope-top-replay", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        previous_unix_seconds: float | None = None
        try:
            for snapshot in read_recording(self._path):
                if previous_unix_seconds is not None:
                    pause_seconds = max(0.0, snapshot.time_unix_seconds - previous_unix_seconds) / self._speed
                    if self._stopping.wait(pause_seconds):
                        return
                previous_unix_seconds = snapshot.time_unix_seconds
                self._events.put(snapshot)
        except (OSError, ValueError) as exc:
            self._events.put(Fatal(f"phasescope top: {exc}", 2))
            return
        self._events.put(Waiting(f"end of the recording {self._path} (q quits)"))


class Keyboard:
    """Single keys from a terminal's stdin (cbreak: no echo, no line buffering, Ctrl-C still interrupts).

    Without a terminal (stdin redirected, or no descriptor at all) there are no keys; `read` only waits.
    """

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        # Set while the terminal is in cbreak mode: its descriptor and the settings to restore.
        self._terminal: tuple[int, list[Any]] | None = None

    def __enter__(self) -> Keyboard:
        try:
            fd = self._stream.fileno()
        except (OSError, ValueError):  # io.UnsupportedOperation is an OSError
            return self
        if os.isatty(fd):
            import termios
            import tty

            self._terminal = (fd, termios.tcgetattr(fd))
            tty.setcbreak(fd)
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._terminal is not None:
            import termios

            fd, saved = self._terminal
            termios.tcsetattr(fd, termios.TCSADRAIN, saved)
            self._terminal = None

    def read(self, timeout_seconds: float) -> str:
        """The keys pressed within `timeout_seconds` ("" when none)."""
        if self._terminal is None:
            time.sleep(timeout_seconds)
            return ""
        import select

        fd = self._terminal[0]
        ready, _, _ = select.select([fd], [], [], timeout_seconds)
        return os.read(fd, 64).decode(errors="ignore") if ready else ""


class Screen:
    """What the main thread holds: the snapshot drawn, the history, the viewer's choices."""

    def __init__(self, newest_first: bool, first_status: str) -> None:
        from phasescope.client.top_view import TokenRateHistory, ViewOptions

        self.history = TokenRateHistory()
        self.options = ViewOptions(newest_first=newest_first)
        self.shown: pb.TelemetrySnapshot | None = None
        # Counts the snapshots shown, so the main loop redraws only when `shown` changed.
        self.shown_count = 0
        # While paused: the history as it was, so the frozen frame's sparklines match it.
        self.frozen_history: TokenRateHistory | None = None
        self.waiting: Waiting | None = Waiting(first_status)

    def receive(self, snapshot: pb.TelemetrySnapshot) -> None:
        self.history.add(snapshot)
        self.waiting = None
        if not self.options.paused:
            self.shown = snapshot
            self.shown_count += 1

    def toggle_pause(self) -> None:
        paused = not self.options.paused
        self.frozen_history = copy.deepcopy(self.history) if paused else None
        self.options = replace(self.options, paused=paused)

    def cycle_sort(self) -> None:
        self.options = replace(self.options, sort_key=self.options.sort_key.next())

    def status(self, now_monotonic: float) -> str:
        if self.waiting is None:
            return ""
        if self.waiting.retry_at_monotonic is None:
            return self.waiting.message
        seconds = max(0, math.ceil(self.waiting.retry_at_monotonic - now_monotonic))
        return f"{self.waiting.message} — reconnecting in {seconds} s"

    def frame(self, width: int, height: int, now_monotonic: float) -> RenderableType:
        from phasescope.client.top_view import render, waiting_frame

        status = self.status(now_monotonic)
        if self.shown is None:
            return waiting_frame(status or "waiting for the first snapshot …")
        history = self.history if self.frozen_history is None else self.frozen_history
        return render(self.shown, history, replace(self.options, status=status), width, height)


def run_screen(
    source: ServerSource | ReplaySource, events: queue.Queue[Event], screen: Screen, recorder: IO[str] | None
) -> int:
    """Draw until `q`, Ctrl-C or a fatal event; returns the exit status."""
    from rich.console import Console
    from rich.live import Live

    console = Console()
    # Drawn only on change (below), never on rich's own timer; the alternate screen leaves the shell as it was.
    live = Live(console=console, screen=True, auto_refresh=False, redirect_stdout=False, redirect_stderr=False)
    fatal: Fatal | None = None
    drawn: tuple[object, ...] = ()
    source.start()
    try:
        with Keyboard(sys.stdin) as keyboard, live:
            while fatal is None:
                keys = keyboard.read(KEY_POLL_SECONDS)
                if "q" in keys or "Q" in keys:
                    break
                for key in keys:
                    if key in "pP":
                        screen.toggle_pause()
                    elif key in "sS":
                        screen.cycle_sort()
                while fatal is None:
                    try:
                        event = events.get_nowait()
                    except queue.Empty:
                        break
                    if isinstance(event, Fatal):
                        fatal = event
                    elif isinstance(event, Waiting):
                        screen.waiting = event
                    else:
                        screen.receive(event)
                        if recorder is not None:
                            recorder.write(recording_line(event))
                            recorder.flush()
                now = time.monotonic()
                size = console.size
                # Redraw only when something visible changed: a new snapshot, a key, the countdown, a resize.
                state = (screen.shown_count, screen.options, screen.status(now), size)
                if state != drawn:
                    drawn = state
                    live.update(screen.frame(size.width, size.height, now), refresh=True)
    except KeyboardInterrupt:
        pass
    finally:
        source.stop()
    if fatal is not None:
        print(fatal.message, file=sys.stderr)
        return fatal.exit_code
    return 0


def once(args: argparse.Namespace, recorder: IO[str] | None) -> int:
    """Print one frame as plain text: the first snapshot of the server's stream or of the recording."""
    import grpc

    from phasescope.client.client import Client
    from phasescope.client.top_view import TokenRateHistory, ViewOptions, render_text

    snapshot: pb.TelemetrySnapshot | None
    if args.replay:
        try:
            snapshot = next(read_recording(Path(args.replay)), None)
        except (OSError, ValueError) as exc:
            print(f"phasescope top: {exc}", file=sys.stderr)
            return 2
        if snapshot is None:
            print(f"phasescope top: {args.replay} holds no snapshot", file=sys.stderr)
            return 2
    else:
        timeout = args.timeout if args.timeout is not None else ONCE_TIMEOUT_SECONDS
        try:
            with Client(args.address, timeout_seconds=timeout, credentials=credentials(args)) as client:
                snapshots = client.watch_telemetry(watch_request(args))
                snapshot = next(snapshots, None)
                _cancel(snapshots)
        except grpc.RpcError as exc:
            print(f"phasescope top: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return _exit_code(exc.code())
        if snapshot is None:
            print("phasescope top: the server ended the stream before its first snapshot", file=sys.stderr)
            return 1
    if recorder is not None:
        recorder.write(recording_line(snapshot))
    history = TokenRateHistory()
    history.add(snapshot)
    options = ViewOptions(newest_first=args.newest_first, show_keys=False)
    sys.stdout.write(render_text(snapshot, history, options, args.width))
    return 0


def cmd(args: argparse.Namespace) -> int:
    if args.record:
        with Path(args.record).open("w") as recorder:
            return _run(args, recorder)
    return _run(args, None)


def _run(args: argparse.Namespace, recorder: IO[str] | None) -> int:
    if args.once:
        return once(args, recorder)
    events: queue.Queue[Event] = queue.Queue()
    source: ServerSource | ReplaySource
    if args.replay:
        source = ReplaySource(Path(args.replay), args.replay_speed, events)
        screen = Screen(args.newest_first, f"reading {args.replay} …")
    else:
        source = ServerSource(args.address, credentials(args), watch_request(args), events)
        screen = Screen(args.newest_first, f"connecting to {args.address} …")
    return run_screen(source, events, screen, recorder)
