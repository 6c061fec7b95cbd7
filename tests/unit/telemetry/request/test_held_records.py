"""Request records held for a moment (ObserverGroup's `hold_seconds`): never lost, never read late."""

import asyncio
import threading
from collections.abc import Callable

import pytest
from prometheus_client import CollectorRegistry

from phasescope.telemetry.errors import TelemetryErrors
from phasescope.telemetry.live import RecentLatencies
from phasescope.telemetry.request import observer as observer_module
from phasescope.telemetry.request.observer import ObserverGroup
from phasescope.telemetry.request.phases import (
    EngineTimestamps,
    FirstTokenRecord,
    FrontendTimestamps,
    PhaseRecord,
    derive_phase_timings,
)
from phasescope.telemetry.request.prometheus import PrometheusRequestObserver

MODEL = "tiny"
REQUESTS = {"model": MODEL, "code": "OK", "finish_reason": "stop"}
FRONT = FrontendTimestamps(
    entry=9.98, wall_at_entry=1.7e9, handed_to_engine=9.99, first_chunk_written=10.32, ended=11.83
)
STAMPS = EngineTimestamps(10.0, 10.01, 10.31, 11.81)
TIMINGS = derive_phase_timings(FRONT, STAMPS, completion_tokens=3)


def first_token() -> FirstTokenRecord:
    return FirstTokenRecord(MODEL, TIMINGS, prefill_tokens_computed=8, streaming=True)


def record() -> PhaseRecord:
    return PhaseRecord(
        model=MODEL,
        code="OK",
        finish_reason="stop",
        prompt_tokens=12,
        cached_prompt_tokens=4,
        completion_tokens=3,
        timings=TIMINGS,
        front=FRONT,
        stamps=STAMPS,
    )


class Spans:
    """An observer that takes no holding (as the tracing observer: a span needs the request's context)."""

    counts_tokens = False

    def __init__(self) -> None:
        self.seen: list[str] = []

    def request_started(self, model: str) -> None:
        self.seen.append("started")

    def request_first_token(self, record: FirstTokenRecord) -> None:
        self.seen.append("first_token")

    def tokens_generated(self, model: str, count: int) -> None:
        pass

    def request_finished(self, record: PhaseRecord) -> None:
        self.seen.append("finished")

    def request_rejected(self, model: str, reason: str) -> None:
        pass


class Kept(Spans):
    """An observer that allows holding, and remembers what it was given and what reads must hand on first."""

    def __init__(self) -> None:
        super().__init__()
        self.hand_on: Callable[[], None] = lambda: None

    def read_after(self, hand_on: Callable[[], None]) -> None:
        self.hand_on = hand_on


def one_request(group: ObserverGroup) -> None:
    group.request_started(MODEL)
    group.request_first_token(first_token())
    group.tokens_generated(MODEL, 3)
    group.request_finished(record())


def test_a_scrape_counts_the_records_held_before_it() -> None:
    registry = CollectorRegistry()
    group = ObserverGroup([PrometheusRequestObserver(registry)], hold_seconds=60.0)

    async def serve() -> tuple[int, float | None, float | None]:
        one_request(group)
        held = group.held
        # The registry collects the hand-on first: a reader sees the request whole.
        return (
            held,
            registry.get_sample_value("phasescope_requests_total", REQUESTS),
            registry.get_sample_value("phasescope_time_to_first_token_seconds_count", {"model": MODEL}),
        )

    held, requests, first_tokens = asyncio.run(serve())
    assert held == 2
    assert (requests, first_tokens) == (1, 1)
    assert group.held == 0
    # Only the records are held: the in-flight gauge rose at the start and fell with the end's record.
    assert registry.get_sample_value("phasescope_requests_in_flight", {"model": MODEL}) == 0
    assert registry.get_sample_value("phasescope_tokens_total", {"model": MODEL, "phase": "decode"}) == 3


def test_held_records_are_handed_on_in_order_once_the_hold_has_passed() -> None:
    kept = Kept()
    group = ObserverGroup([kept], hold_seconds=0.02)

    async def serve() -> tuple[list[str], list[str]]:
        one_request(group)
        one_request(group)
        before = list(kept.seen)
        await asyncio.sleep(0.2)
        return before, list(kept.seen)

    before, after = asyncio.run(serve())
    assert before == ["started", "started"]
    assert after == ["started", "started", "first_token", "finished", "first_token", "finished"]
    assert group.held == 0


def test_observers_that_take_no_holding_get_records_at_once() -> None:
    spans, kept = Spans(), Kept()
    group = ObserverGroup([spans, kept], hold_seconds=60.0)

    async def serve() -> None:
        one_request(group)

    asyncio.run(serve())
    assert spans.seen == ["started", "first_token", "finished"]
    assert kept.seen == ["started"]
    kept.hand_on()  # what a read of `kept` calls first
    assert kept.seen == ["started", "first_token", "finished"]


def test_the_live_view_hands_on_what_is_held_before_its_figures() -> None:
    recent = RecentLatencies()
    group = ObserverGroup([recent], hold_seconds=60.0)

    async def serve() -> int:
        one_request(group)
        return recent.figures(60.0).time_to_first_token_samples

    assert asyncio.run(serve()) == 1


def test_records_are_handed_on_at_once_off_an_event_loop_and_beyond_the_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kept = Kept()
    group = ObserverGroup([kept], hold_seconds=60.0)
    one_request(group)  # no running loop: no timer could hand them on later
    assert kept.seen == ["started", "first_token", "finished"]

    monkeypatch.setattr(observer_module, "MAX_HELD_RECORDS", 3)
    kept.seen.clear()

    async def serve() -> int:
        one_request(group)  # two held
        group.request_first_token(first_token())  # the third: all handed on
        return group.held

    assert asyncio.run(serve()) == 0
    assert kept.seen == ["started", "first_token", "finished", "first_token"]


def test_a_held_observer_that_fails_costs_its_own_figures_only() -> None:
    registry = CollectorRegistry()

    class Broken(Kept):
        def request_finished(self, record: PhaseRecord) -> None:
            raise RuntimeError("broken")

    errors = TelemetryErrors(MODEL, registry)
    group = ObserverGroup([Broken(), PrometheusRequestObserver(registry)], on_error=errors, hold_seconds=60.0)

    async def serve() -> None:
        one_request(group)

    asyncio.run(serve())
    assert registry.get_sample_value("phasescope_requests_total", REQUESTS) == 1
    failures = {"model": MODEL, "component": "observer"}
    assert registry.get_sample_value("phasescope_telemetry_errors_total", failures) == 1


def test_a_scrape_from_another_thread_while_requests_end_loses_no_record() -> None:
    registry = CollectorRegistry()
    group = ObserverGroup([PrometheusRequestObserver(registry)], hold_seconds=60.0)
    stop = threading.Event()

    def scrape() -> None:
        while not stop.is_set():
            registry.get_sample_value("phasescope_requests_total", REQUESTS)

    async def serve() -> None:
        for _ in range(2000):
            one_request(group)
            await asyncio.sleep(0)

    scraper = threading.Thread(target=scrape)
    scraper.start()
    try:
        asyncio.run(serve())
    finally:
        stop.set()
        scraper.join()
    assert registry.get_sample_value("phasescope_requests_total", REQUESTS) == 2000
    assert registry.get_sample_value("phasescope_time_to_first_token_seconds_count", {"model": MODEL}) == 2000
    assert registry.get_sample_value("phasescope_requests_in_flight", {"model": MODEL}) == 0


def test_an_ended_request_s_record_is_built_only_when_it_is_handed_on() -> None:
    kept = Kept()
    group = ObserverGroup([kept], hold_seconds=60.0)
    built: list[PhaseRecord] = []

    def build() -> PhaseRecord:
        built.append(record())
        return built[-1]

    async def serve() -> int:
        group.request_finished_later(build)
        return len(built)

    assert asyncio.run(serve()) == 0
    kept.hand_on()
    assert len(built) == 1
    assert kept.seen == ["finished"]


def test_an_ended_request_s_record_is_built_at_once_for_an_observer_that_takes_it_at_once() -> None:
    spans, kept = Spans(), Kept()
    group = ObserverGroup([spans, kept], hold_seconds=60.0)

    async def serve() -> None:
        group.request_finished_later(record)

    asyncio.run(serve())
    assert spans.seen == ["finished"]
    kept.hand_on()
    assert kept.seen == ["finished"]


def test_a_record_that_cannot_be_built_costs_that_record_only() -> None:
    registry = CollectorRegistry()
    errors = TelemetryErrors(MODEL, registry)
    group = ObserverGroup([PrometheusRequestObserver(registry)], on_error=errors, hold_seconds=60.0)

    def broken() -> PhaseRecord:
        raise RuntimeError("broken")

    async def serve() -> None:
        group.request_finished_later(broken)
        group.request_finished_later(record)

    asyncio.run(serve())
    assert registry.get_sample_value("phasescope_requests_total", REQUESTS) == 1
    failures = {"model": MODEL, "component": "observer"}
    assert registry.get_sample_value("phasescope_telemetry_errors_total", failures) == 1


def test_hand_on_soon_delivers_what_is_held_after_the_ready_callbacks_not_at_the_hold_s_end() -> None:
    kept = Kept()
    group = ObserverGroup([kept], hold_seconds=60.0)

    async def serve() -> tuple[list[str], list[str], bool]:
        group.hand_on_soon()  # nothing held: nothing to do
        one_request(group)
        order: list[str] = []
        # A chunk's write, ready before the request path says no request waits for a first token.
        asyncio.get_running_loop().call_soon(lambda: order.append(f"ready with {len(kept.seen)} seen"))
        group.hand_on_soon()
        group.hand_on_soon()  # asked twice before it ran: runs once
        before = list(kept.seen)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        return before, order, group._timer is None

    before, order, timer_gone = asyncio.run(serve())
    assert before == ["started"]
    assert order == ["ready with 1 seen"]  # what was ready ran first
    assert kept.seen == ["started", "first_token", "finished"]
    assert timer_gone  # the hold's timer is cancelled: nothing is left for it
    one_request(group)  # off an event loop: handed on at once
    group.hand_on_soon()
    assert kept.seen.count("finished") == 2


def test_a_first_token_s_record_is_built_only_when_it_is_handed_on() -> None:
    kept = Kept()
    group = ObserverGroup([kept], hold_seconds=60.0)
    built: list[FirstTokenRecord] = []

    def build() -> FirstTokenRecord:
        built.append(first_token())
        return built[-1]

    async def serve() -> int:
        group.request_first_token_later(build)
        return len(built)

    assert asyncio.run(serve()) == 0
    kept.hand_on()
    assert len(built) == 1
    assert kept.seen == ["first_token"]
