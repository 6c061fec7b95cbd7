"""The step reports' way out of the engine core: a publisher that never blocks the engine loop, one hub that hears
every engine core, over real ZMQ sockets."""

import asyncio
import functools
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import zmq

from phasescope.environment import (
    TELEMETRY_ENDPOINT,
    TELEMETRY_GATHER,
    env_telemetry_endpoint,
    env_telemetry_gather_seconds,
    export_telemetry_endpoint,
)
from phasescope.telemetry.step.records import (
    EngineFacts,
    EngineIteration,
    PublisherHealth,
    SchedulerState,
    SpeculativeStep,
    StepForwarder,
    StepRecord,
    StepReport,
)
from phasescope.telemetry.step.transport import ReportBatch, StepHub, StepPublisher, decode, encode
from support.engine_facts import tiny_engine_facts


def report(engine: int, decode_tokens: int = 4) -> StepReport:
    return StepReport(
        iteration=EngineIteration(engine, (0.01, 0.02), 1, inter_token_counts=(3, 1)),
        scheduler=SchedulerState(engine, 4, 2, 0.5, 1, "slot"),
        step=StepRecord(
            engine, 1, 30, decode_tokens, decode_tokens, 0.02, 1e9, 2e8, 1e6, 800, SpeculativeStep(2, 6, 3, (2, 1, 0))
        ),
    )


class Received:
    """What a hub delivered, and a way to wait until it holds enough."""

    def __init__(self) -> None:
        self.reports: list[StepReport] = []
        self._changed = threading.Condition()

    def __call__(self, reports: list[StepReport]) -> None:
        with self._changed:
            self.reports.extend(reports)
            self._changed.notify_all()

    def wait_for(self, condition: Callable[[list[StepReport]], bool], timeout: float = 10.0) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: condition(self.reports), timeout)


def steps(reports: list[StepReport]) -> list[StepRecord]:
    return [report.step for report in reports if report.step is not None]


def holds_steps(count: int, reports: list[StepReport]) -> bool:
    return len(steps(reports)) == count


def test_a_batch_is_the_same_on_both_sides_of_the_wire() -> None:
    batch = ReportBatch([report(0), StepReport(scheduler=SchedulerState(0, 0, 0, 0.0))], PublisherHealth(0, 2, 0.5, 9))
    assert decode(encode(batch)) == batch


def test_every_engine_cores_reports_reach_the_one_hub_in_order_with_each_publishers_health() -> None:
    received = Received()
    hub = StepHub(received).start()
    publishers = [StepPublisher(hub.endpoint, engine) for engine in (0, 1)]
    try:
        for publisher in publishers:
            publisher.start()
        for tokens in range(1, 51):
            for publisher in publishers:
                publisher.publish(report(publisher.engine, tokens))
        assert received.wait_for(lambda reports: len(steps(reports)) == 100)
        for engine in (0, 1):
            of_engine = [step.decode_tokens for step in steps(received.reports) if step.engine == engine]
            assert of_engine == list(range(1, 51))
        healths = [report.publisher for report in received.reports if report.publisher is not None]
        assert {health.engine for health in healths} == {0, 1}
        assert all(health.dropped_reports == 0 for health in healths)
    finally:
        for publisher in publishers:
            publisher.close()
        hub.close()


def test_a_busy_spells_reports_gather_into_one_message_and_without_gathering_each_goes_on_its_own() -> None:
    # Behind another front end a busy engine core wakes the hub once a period, not once a step.
    for gather_seconds, most_messages in ((0.5, 2), (0.0, 20)):
        received = Received()
        hub = StepHub(received).start()
        publisher = StepPublisher(hub.endpoint, 0, gather_seconds=gather_seconds)
        publisher.start()
        try:
            for tokens in range(1, 21):
                publisher.publish(report(0, tokens))
                if not gather_seconds:
                    assert received.wait_for(functools.partial(holds_steps, tokens))
            assert received.wait_for(lambda reports: len(steps(reports)) == 20)
            assert [step.decode_tokens for step in steps(received.reports)] == list(range(1, 21))
            assert hub.batches <= most_messages
            if not gather_seconds:
                assert hub.batches == 20
        finally:
            publisher.close()
            hub.close()


def test_the_gathering_period_the_engine_cores_inherit(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (TELEMETRY_ENDPOINT, TELEMETRY_GATHER):  # put back as they were when the test ends
        monkeypatch.setenv(name, "")
    export_telemetry_endpoint("ipc:///hub", gather_seconds=0.0)
    assert (env_telemetry_endpoint(), env_telemetry_gather_seconds()) == ("ipc:///hub", 0.0)
    export_telemetry_endpoint("ipc:///hub")  # the publishers' own default
    assert env_telemetry_gather_seconds() is None
    monkeypatch.setenv(TELEMETRY_GATHER, "soon")
    assert env_telemetry_gather_seconds() is None


def test_a_full_queue_drops_and_counts_the_newest_report_without_waiting() -> None:
    # The engine loop never waits on telemetry: the publisher's thread has not taken anything yet.
    publisher = StepPublisher("ipc:///nowhere", 0, queue_reports=2)
    for tokens in range(5):
        publisher.publish(report(0, tokens))
    assert publisher.dropped_reports == 3
    assert [item.step.decode_tokens for item in publisher._queue if item.step is not None] == [0, 1]


def test_with_no_hub_listening_the_publisher_drops_and_counts_and_stops_when_closed(tmp_path: Path) -> None:
    # A hub's address that no hub holds, nor ever will: the sends find no peer. (A TCP port freed for the test
    # can be taken by another process's listener on a busy machine, and then the send finds one.)
    publisher = StepPublisher(f"ipc://{tmp_path / 'no-hub'}", 0)
    publisher.start()
    publisher.publish(report(0))
    publisher.close(timeout_seconds=5.0)
    assert publisher.dropped_reports == 1
    assert publisher._thread is not None
    assert not publisher._thread.is_alive()


def test_a_message_that_is_not_a_batch_costs_that_message_only() -> None:
    received, errors = Received(), list[BaseException]()
    hub = StepHub(received, on_error=errors.append).start()
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sender = context.socket(zmq.PUSH)
    sender.connect(hub.endpoint)
    try:
        sender.send(b"not a batch")
        sender.send(encode(ReportBatch([report(3)], PublisherHealth(3, 0, 0.0, 1))))
        assert received.wait_for(lambda reports: len(steps(reports)) == 1)
        assert len(errors) == 1
    finally:
        sender.close(linger=0)
        hub.close()


def test_a_hub_can_listen_on_tcp_for_engine_cores_started_elsewhere() -> None:
    received = Received()
    hub = StepHub(received, "tcp://127.0.0.1:0").start()
    publisher = StepPublisher(hub.endpoint, 0)
    try:
        assert hub.endpoint.startswith("tcp://127.0.0.1:")
        assert not hub.endpoint.endswith(":0")
        publisher.start()
        publisher.publish(report(0))
        assert received.wait_for(lambda reports: len(steps(reports)) == 1)
    finally:
        publisher.close()
        hub.close()


async def test_reports_from_the_hubs_thread_reach_the_sink_on_the_event_loop() -> None:
    loop_thread = threading.get_ident()
    seen: list[tuple[int, StepReport]] = []
    forward = StepForwarder()
    forward.attach(lambda item: seen.append((threading.get_ident(), item)))
    hub = StepHub(forward.report_batch).start()
    publisher = StepPublisher(hub.endpoint, 0)
    publisher.start()
    try:
        publisher.publish(report(0))
        for _ in range(500):
            if any(item.step is not None for _, item in seen):
                break
            await asyncio.sleep(0.01)
        assert [thread for thread, item in seen if item.step is not None] == [loop_thread]
    finally:
        publisher.close()
        hub.close()


def facts(engine: int) -> EngineFacts:
    return tiny_engine_facts(engine)


def test_an_engine_cores_facts_reach_the_hub_before_its_reports_and_again_every_few_seconds() -> None:
    # A hub started after the engine still learns what it needs to judge the steps.
    received, told = Received(), list[tuple[EngineFacts, int]]()
    hub = StepHub(received, on_facts=lambda given: told.append((given, len(steps(received.reports))))).start()
    clock = [0.0]
    publisher = StepPublisher(hub.endpoint, 0, facts=facts(0), clock=lambda: clock[0])
    publisher.start()
    try:
        for sent, second in enumerate((0.0, 1.0, 2.0, 6.0), start=1):
            clock[0] = second
            publisher.publish(report(0))
            assert received.wait_for(lambda reports, sent=sent: len(steps(reports)) == sent)  # type: ignore[misc]  # a default binds the loop's value
        # At 0 s (the first batch, before any report) and at 6 s (5 s after): not in between.
        assert [(given.engine, reports_before) for given, reports_before in told] == [(0, 0), (0, 3)]
        assert told[0][0] == facts(0)
    finally:
        publisher.close()
        hub.close()
