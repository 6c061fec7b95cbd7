"""How step reports leave the engine core: a publisher in each engine core, one hub in the phasescope process.

The engine loop is the hot path (DESIGN.md, "Where the telemetry lives"). As vLLM's KV-event publisher
(`vllm/distributed/kv_events.py`) does, the loop only puts a report on a bounded queue, and a background thread
encodes what has gathered (msgspec msgpack) and sends it over ZMQ (PUSH to the hub's PULL). Unlike vLLM's, the
publisher never blocks: a full queue, or a hub that is not there, drops the report and counts it. Each batch
carries its engine core's `PublisherHealth` (reports dropped, the hook's time on the engine loop), so the cost
of watching is itself watched.

The hub binds, the publishers connect: any number of engine cores (data parallelism) and any front end (phasescope's
own, smg's Rust request path, vLLM's OpenAI server) feed one hub, and every step is counted once, by the core that
ran it. The hub hands each batch's reports to one callable from its own thread (`StepForwarder.report_batch` moves
them onto the event loop behind phasescope's own request path, and aggregates them on the hub's thread behind any
other).
"""

from __future__ import annotations

import collections
import logging
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec
import zmq

from phasescope.telemetry.step.records import EngineFacts, PublisherHealth, StepReport

logger = logging.getLogger(__name__)

DEFAULT_QUEUE_REPORTS = 4096
"""Reports an engine core holds for its publisher's thread before it drops the newest (minutes of steps)."""
SEND_HIGH_WATER_MARK = 1024
"""Batches ZMQ holds for a slow or absent hub before a send would block (then the batch is dropped)."""
SEND_WAIT_MILLISECONDS = 100
"""How long the publisher's thread waits for a hub that cannot take a batch yet before it drops it."""
FACTS_EVERY_SECONDS = 5.0
"""How often an engine core repeats its facts, so that a hub started after it learns them."""
HELLO_WAIT_MILLISECONDS = 2000
"""How long a starting publisher waits for its hub to take the core's facts (they go with a later batch if not)."""
POLL_MILLISECONDS = 200
"""How often an idle hub looks whether it was closed."""
GATHER_SECONDS = 0.05
"""How long a publisher lets reports gather after the first of a busy spell before it sends them as one batch:
one message and one wake-up of the hub for every 50 ms of steps instead of every step."""


@dataclass(frozen=True, slots=True)
class ReportBatch:
    """One message on the wire: the reports an engine core gathered since its last, its publisher's health, and
    now and then the core's facts."""

    reports: list[StepReport]
    health: PublisherHealth
    facts: EngineFacts | None = None


_encoder = msgspec.msgpack.Encoder()


def encode(batch: ReportBatch) -> bytes:
    return _encoder.encode(batch)


_decoder = msgspec.msgpack.Decoder(ReportBatch)


def decode(message: bytes) -> ReportBatch:
    """A batch from the wire; `msgspec.DecodeError` (a ValueError) when it is not one."""
    return _decoder.decode(message)


class StepPublisher:
    """The engine core's side: `publish` appends (and wakes the thread for the first report of a busy spell);
    nothing on the engine loop waits.

    The thread sends what gathered `gather_seconds` after it woke, so a busy engine core costs the hub one
    message per period, and the engine loop one wake-up of another thread per period, not per step (0: each
    report as soon as the thread runs, for a hub whose front end reads the engine's totals as a request's tokens
    come). A report appended just as the thread empties the queue can wait for its next look, a second at most.
    """

    def __init__(
        self,
        endpoint: str,
        engine: int,
        *,
        facts: EngineFacts | None = None,
        queue_reports: int = DEFAULT_QUEUE_REPORTS,
        gather_seconds: float = GATHER_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self._gather_seconds = gather_seconds
        self._facts = facts
        self._facts_sent_at: float | None = None
        self._clock = clock
        self._endpoint = endpoint
        self._capacity = queue_reports
        self._queue: collections.deque[StepReport] = collections.deque()
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._closed = False
        # Cumulative; written by the engine loop (and by the thread for sends that fail), read by the thread.
        self.dropped_reports = 0
        self.hook_seconds = 0.0
        self.hook_calls = 0
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="phasescope-step-publisher", daemon=True)
        self._thread.start()

    def publish(self, report: StepReport) -> None:
        """Called by the engine loop once per step (which adds what its hook took to `hook_seconds`)."""
        queue = self._queue
        if len(queue) >= self._capacity:
            self.dropped_reports += 1
            return
        first = not queue
        queue.append(report)
        if first:
            self._wake.set()

    def health(self) -> PublisherHealth:
        return PublisherHealth(self.engine, self.dropped_reports, self.hook_seconds, self.hook_calls)

    def close(self, timeout_seconds: float = 1.0) -> None:
        """Send what is queued (within `timeout_seconds`) and stop the thread."""
        self._closed = True
        self._closing.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_seconds)

    def _take(self) -> list[StepReport]:
        taken = []
        queue = self._queue
        while queue:
            taken.append(queue.popleft())
        return taken

    def _run(self) -> None:
        context = zmq.Context()
        socket = context.socket(zmq.PUSH)
        socket.setsockopt(zmq.SNDHWM, SEND_HIGH_WATER_MARK)
        # Queue only for a hub that is connected: with none, a send fails at once and the batch is counted as
        # dropped, instead of waiting in a queue for a hub that may never come.
        socket.setsockopt(zmq.IMMEDIATE, 1)
        socket.setsockopt(zmq.LINGER, 500)
        socket.connect(self._endpoint)
        try:
            if self._facts is not None:
                # The core's facts at once, so that a hub wires its series before the first request.
                self._send(socket, [], wait_milliseconds=HELLO_WAIT_MILLISECONDS)
            while True:
                if not self._queue:  # reports that came while the last batch was sent go without a wake-up
                    self._wake.wait(1.0)
                if not self._closed and self._gather_seconds:
                    self._closing.wait(self._gather_seconds)
                self._wake.clear()
                reports = self._take()
                if reports:
                    self._send(socket, reports)
                if self._closed:
                    break
        finally:
            socket.close()
            context.term()

    def _send(self, socket: zmq.Socket[bytes], reports: list[StepReport], wait_milliseconds: int = 0) -> None:
        try:
            now = self._clock()
            due = self._facts_sent_at is None or now - self._facts_sent_at >= FACTS_EVERY_SECONDS
            message = encode(ReportBatch(reports, self.health(), self._facts if due else None))
            # This thread (never the engine loop) gives a hub that is connecting, or slow, a moment.
            if not socket.poll(wait_milliseconds or SEND_WAIT_MILLISECONDS, zmq.POLLOUT):
                raise zmq.Again
            socket.send(message, zmq.NOBLOCK)
            if due:
                self._facts_sent_at = now
        except zmq.Again:  # the hub is slow or gone: the batch is dropped
            self.dropped_reports += len(reports)
        except Exception:  # a report that cannot be encoded costs its batch, never the engine
            self.dropped_reports += len(reports)
            logger.exception("phasescope's step publisher could not send %d reports", len(reports))


def _ipc_endpoint() -> tuple[str, Path]:
    folder = Path(tempfile.mkdtemp(prefix="phasescope-steps-"))
    return f"ipc://{folder / 'steps'}", folder


class StepHub:
    """The phasescope process's side: binds, receives every engine core's batches, and hands their reports on.

    `deliver` is called from the hub's thread with each batch's reports followed by a report of the publisher's
    health, and `on_facts` with an engine core's facts before its batch's reports; a message that is not a batch
    goes to `on_error` and costs that message only.
    """

    def __init__(
        self,
        deliver: Callable[[list[StepReport]], None],
        endpoint: str = "",
        on_error: Callable[[BaseException], None] = lambda exc: None,
        on_facts: Callable[[EngineFacts], None] = lambda facts: None,
    ) -> None:
        """`endpoint`: where to bind (a ZMQ address; tcp://HOST:0 picks a port); empty: a fresh ipc path."""
        self._deliver = deliver
        self._on_error = on_error
        self._on_facts = on_facts
        self._folder: Path | None = None
        if not endpoint:
            endpoint, self._folder = _ipc_endpoint()
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PULL)
        self._socket.bind(endpoint)
        # What publishers connect to (a port chosen for tcp://HOST:0 filled in).
        self.endpoint: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="phasescope-step-hub", daemon=True)
        self.batches = 0

    def start(self) -> StepHub:
        self._thread.start()
        return self

    def close(self) -> None:
        self._closed.set()
        if self._thread.is_alive():
            self._thread.join(2 * POLL_MILLISECONDS / 1000 + 1.0)
        self._socket.close(linger=0)
        self._context.term()
        if self._folder is not None:
            for path in self._folder.iterdir():
                path.unlink(missing_ok=True)
            self._folder.rmdir()

    def _run(self) -> None:
        socket = self._socket
        while not self._closed.is_set():
            if not socket.poll(POLL_MILLISECONDS):
                continue
            reports: list[StepReport] = []
            # Everything that has arrived, handed on as one delivery (asking the socket, not catching zmq.Again).
            while int(socket.get(zmq.EVENTS)) & zmq.POLLIN:
                message = socket.recv(zmq.NOBLOCK)
                try:
                    batch = decode(message)
                except ValueError as exc:
                    self._on_error(exc)
                    continue
                self.batches += 1
                if batch.facts is not None:
                    if reports:  # the reports before it first, in order
                        self._hand_on(reports)
                        reports = []
                    try:
                        self._on_facts(batch.facts)
                    except Exception as exc:
                        self._on_error(exc)
                reports.extend(batch.reports)
                reports.append(StepReport(publisher=batch.health))
            if reports:
                self._hand_on(reports)

    def _hand_on(self, reports: list[StepReport]) -> None:
        try:
            self._deliver(reports)
        except Exception as exc:
            self._on_error(exc)
