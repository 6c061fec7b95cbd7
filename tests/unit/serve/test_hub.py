"""The hub on its own (behind a front end phasescope does not run): its series wired from the engine cores' facts."""

import asyncio
import logging

import pytest
from prometheus_client import CollectorRegistry

from phasescope.serve import build, hub
from phasescope.serve.config import Settings
from phasescope.telemetry.hardware.peaks import HardwarePeaks
from phasescope.telemetry.pipeline import TelemetryPipeline
from phasescope.telemetry.step.records import EngineRequestRecord, StepForwarder, StepRecord, StepReport
from support.engine_facts import tiny_engine_facts

FACTS = tiny_engine_facts()


def telemetry(registry: CollectorRegistry) -> hub.HubTelemetry:
    return hub.HubTelemetry(Settings(), registry, StepForwarder(), TelemetryPipeline())


def judged_against(monkeypatch: pytest.MonkeyPatch, peaks: HardwarePeaks) -> None:
    # The hub judges as phasescope's own request path does (phasescope.serve.build.judged_against).
    monkeypatch.setattr(build, "resolve_peaks", lambda settings, device, on_cpu, dtype: peaks)


async def test_the_first_facts_wire_the_series_and_the_steps_that_came_before_them_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    judged_against(monkeypatch, HardwarePeaks("cpu", 1e10, {"fp32": 1e11}, "flag"))
    registry = CollectorRegistry()
    wired = telemetry(registry)
    # A step the hub received while the peaks were still being resolved.
    wired.steps.report_batch([StepReport(step=StepRecord(0, 1, 30, 0, 0, 0.01))])
    wired.engine_facts(FACTS)
    wired.engine_facts(FACTS)  # the core repeats its facts every few seconds: wired once
    assert wired._attaching is not None
    await wired._attaching
    assert wired.ready.is_set()
    wired.pipeline.hand_on()
    labels = {"model": "tiny", "engine": "0", "phase": "prefill"}
    assert registry.get_sample_value("phasescope_engine_step_tokens_total", labels) == 30


async def test_a_device_without_the_served_dtypes_peak_is_one_error_line_and_no_series(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    judged_against(monkeypatch, HardwarePeaks("cpu", 1e10, {}, "flag"))
    registry = CollectorRegistry()
    unwired = telemetry(registry)
    with caplog.at_level(logging.ERROR, logger="phasescope.serve.hub"):
        unwired.engine_facts(FACTS)
        assert unwired._attaching is not None
        await unwired._attaching
    assert unwired.aggregator is None
    assert not unwired.ready.is_set()
    (record,) = caplog.records
    assert "no step series for tiny on cpu (test)" in record.getMessage()
    assert "--peak-flops" in record.getMessage()


async def test_a_finished_requests_record_reaches_whoever_waits_for_it_before_any_scrape(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # phasescope.v1 beside smg's Rust server ends each answer with its engine record's stamps: the record may not
    # wait in the telemetry pipeline for the next scrape.
    judged_against(monkeypatch, HardwarePeaks("cpu", 1e10, {"fp32": 1e11}, "flag"))
    wired = telemetry(CollectorRegistry())
    wired.engine_facts(FACTS)
    assert wired._attaching is not None
    await wired._attaching
    waited = wired.claims.claim("req-1")
    finished = EngineRequestRecord(0, "length", 5, 0, 3, 1.0, 1.1, 1.2, 1.3, request_id="req-1")
    wired.steps.report_batch([StepReport(finished=(finished,))])
    assert wired.pipeline.held  # the series still wait for a reader
    assert await asyncio.wait_for(waited, 5) == finished
