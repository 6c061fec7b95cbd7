"""The telemetry pipeline: reports wait, in order, and are handed on together; never lost, never read late."""

from __future__ import annotations

import asyncio
import threading

from prometheus_client import CollectorRegistry

from phasescope.telemetry.errors import TelemetryErrors
from phasescope.telemetry.live import RecentLatencies
from phasescope.telemetry.pipeline import FirstTokenWaits, TelemetryPipeline
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
REQUESTS = {"model": MODEL, "adapter": "base", "code": "OK", "finish_reason": "stop"}
FRONT = FrontendTimestamps(
    entry=9.98, wall_at_entry=1.7e9, handed_to_engine=9.99, first_chunk_written=10.32, ended=11.83
)
STAMPS = EngineTimestamps(10.0, 10.01, 10.31, 11.81)
TIMINGS = derive_phase_timings(FRONT, STAMPS, completion_tokens=3)


def first_token() -> FirstTokenRecord:
    return FirstTokenRecord(MODEL, TIMINGS, prefill_tokens_computed=8, streaming=True)


def record() -> PhaseRecord:
    return PhaseRecord(
        model=MODEL, code="OK", finish_reason="stop", prompt_tokens=12, cached_prompt_tokens=4,
        completion_tokens=3, timings=TIMINGS, front=FRONT, stamps=STAMPS,
    )  # fmt: skip


class Spans:
    """An observer that gets everything at once (as the tracing observer: a span needs its request's context)."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def request_started(self, model: str, adapter: str = "base") -> None:
        self.seen.append("started")

    def request_first_token(self, record: FirstTokenRecord) -> None:
        self.seen.append("first_token")

    def tokens_generated(self, model: str, count: int, adapter: str = "base") -> None:
        self.seen.append("tokens")

    def request_finished(self, record: PhaseRecord) -> None:
        self.seen.append("finished")

    def request_rejected(self, model: str, reason: str, adapter: str = "base") -> None:
        self.seen.append("rejected")


def one_request(group: ObserverGroup) -> None:
    group.request_started(MODEL)
    group.request_first_token(first_token())
    group.tokens_generated(MODEL, 3)
    group.request_finished(record())


def test_reports_are_delivered_in_the_order_they_came_when_handed_on() -> None:
    pipeline = TelemetryPipeline(batch=100)
    seen: list[int] = []
    for index in range(5):
        pipeline.hold(seen.append, index)
    assert (seen, pipeline.held) == ([], 5)
    pipeline.hand_on()
    assert (seen, pipeline.held) == ([0, 1, 2, 3, 4], 0)


async def test_a_full_batch_goes_after_what_the_loop_has_ready() -> None:
    # vLLM's output handler fills a batch right after it woke the step's requests: their chunks go first.
    pipeline = TelemetryPipeline(batch=2)
    order: list[str] = []
    asyncio.get_running_loop().call_soon(lambda: order.append("a request's chunk"))
    pipeline.hold(order.append, "report 1")
    pipeline.hold(order.append, "report 2")  # the batch is full
    pipeline.hold(order.append, "report 3")  # one more before it ran: handed on with it, once
    assert order == []
    await asyncio.sleep(0)
    assert order == ["a request's chunk", "report 1", "report 2", "report 3"]


async def test_a_batch_waits_while_a_request_waits_for_its_first_token_and_goes_once_none_does() -> None:
    waits = FirstTokenWaits()
    waits.started()
    pipeline = TelemetryPipeline(waits, batch=1)
    handed: list[str] = []
    pipeline.hold(handed.append, "batch")
    await asyncio.sleep(0.02)
    assert handed == []
    waits.settled()
    await asyncio.sleep(0.02)
    assert handed == ["batch"]


async def test_a_batch_never_waits_longer_than_its_bound() -> None:
    waits = FirstTokenWaits()
    waits.started()  # a load under which some request always waits
    pipeline = TelemetryPipeline(waits, batch=1, longest_wait_seconds=0.05)
    handed: list[str] = []
    pipeline.hold(handed.append, "batch")
    await asyncio.sleep(0.02)
    assert handed == []
    await asyncio.sleep(0.1)
    assert handed == ["batch"]


def test_off_an_event_loop_a_full_batch_goes_at_once() -> None:
    pipeline = TelemetryPipeline(batch=1)
    handed: list[str] = []
    pipeline.hold(handed.append, "batch")
    assert handed == ["batch"]


async def test_a_scrape_counts_the_records_held_before_it() -> None:
    registry = CollectorRegistry()
    pipeline = TelemetryPipeline(batch=1000)
    registry.register(pipeline.scrape_hook())
    request_metrics = PrometheusRequestObserver()
    registry.register(request_metrics)
    group = ObserverGroup(batched=[request_metrics], pipeline=pipeline)
    one_request(group)
    assert pipeline.held == 2  # the first token's record and the end's; the rest went at once
    # The registry collects the hook first: a reader sees the request whole.
    assert registry.get_sample_value("phasescope_requests_total", REQUESTS) == 1
    assert (
        registry.get_sample_value("phasescope_time_to_first_token_seconds_count", {"model": MODEL, "adapter": "base"})
        == 1
    )
    assert pipeline.held == 0
    assert registry.get_sample_value("phasescope_requests_in_flight", {"model": MODEL, "adapter": "base"}) == 0
    assert (
        registry.get_sample_value("phasescope_tokens_total", {"model": MODEL, "adapter": "base", "phase": "decode"})
        == 3
    )


async def test_direct_observers_get_records_at_once_batched_ones_when_handed_on() -> None:
    spans, batched = Spans(), Spans()
    pipeline = TelemetryPipeline(batch=1000)
    group = ObserverGroup([spans], [batched], pipeline=pipeline)
    one_request(group)
    assert spans.seen == ["started", "first_token", "tokens", "finished"]
    assert batched.seen == ["started", "tokens"]
    pipeline.hand_on()
    assert batched.seen == ["started", "tokens", "first_token", "finished"]


async def test_the_live_view_reads_what_was_handed_on() -> None:
    recent = RecentLatencies()
    pipeline = TelemetryPipeline(batch=1000)
    one_request(ObserverGroup(batched=[recent], pipeline=pipeline))
    assert recent.figures(60.0).time_to_first_token_samples == 0
    pipeline.hand_on()  # what the live view's reader calls first (phasescope.serve.build.LiveTelemetry)
    assert recent.figures(60.0).time_to_first_token_samples == 1


async def test_a_batched_observer_that_fails_costs_its_own_figures_only() -> None:
    registry = CollectorRegistry()

    class Broken(Spans):
        def request_finished(self, record: PhaseRecord) -> None:
            raise RuntimeError("broken")

    errors = TelemetryErrors(MODEL)
    registry.register(errors)
    pipeline = TelemetryPipeline(batch=1000, on_error=errors)
    registry.register(pipeline.scrape_hook())
    request_metrics = PrometheusRequestObserver()
    registry.register(request_metrics)
    group = ObserverGroup(batched=[Broken(), request_metrics], pipeline=pipeline, on_error=errors)
    one_request(group)
    assert registry.get_sample_value("phasescope_requests_total", REQUESTS) == 1
    failures = {"model": MODEL, "component": "observer"}
    assert registry.get_sample_value("phasescope_telemetry_errors_total", failures) == 1


def test_a_report_that_fails_costs_that_report_only() -> None:
    failures: list[str] = []
    pipeline = TelemetryPipeline(batch=1000, on_error=lambda component, exc: failures.append(str(exc)))
    seen: list[int] = []

    def deliver(value: int) -> None:
        if value == 2:
            raise RuntimeError("a defect")
        seen.append(value)

    for value in (1, 2, 3):
        pipeline.hold(deliver, value)
    pipeline.hand_on()
    assert (seen, failures) == ([1, 3], ["a defect"])


async def test_a_scrape_from_another_thread_while_requests_end_loses_no_record() -> None:
    registry = CollectorRegistry()
    pipeline = TelemetryPipeline(batch=96)
    registry.register(pipeline.scrape_hook())
    request_metrics = PrometheusRequestObserver()
    registry.register(request_metrics)
    group = ObserverGroup(batched=[request_metrics], pipeline=pipeline)
    stop = threading.Event()

    def scrape() -> None:
        while not stop.is_set():
            registry.get_sample_value("phasescope_requests_total", REQUESTS)

    scraper = threading.Thread(target=scrape)
    scraper.start()
    try:
        for _ in range(2000):
            one_request(group)
            await asyncio.sleep(0)
    finally:
        stop.set()
        scraper.join()
    assert registry.get_sample_value("phasescope_requests_total", REQUESTS) == 2000
    assert (
        registry.get_sample_value("phasescope_time_to_first_token_seconds_count", {"model": MODEL, "adapter": "base"})
        == 2000
    )
    assert registry.get_sample_value("phasescope_requests_in_flight", {"model": MODEL, "adapter": "base"}) == 0
