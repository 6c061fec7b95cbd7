"""The hub's replay (loadtests/hub_cost.py) on a capture written here: it counts what the capture carried and
hands every report to the hub's series."""

from pathlib import Path

import pytest

from loadtests import hub_cost
from phasescope.telemetry.step.records import (
    EngineIteration,
    EngineRequestRecord,
    PublisherHealth,
    SchedulerState,
    StepRecord,
    StepReport,
)
from phasescope.telemetry.step.transport import ReportBatch, encode
from support.engine_facts import tiny_engine_facts


def decode_step(tokens: int) -> StepReport:
    return StepReport(
        iteration=EngineIteration(0, (0.01,), 0, tokens, inter_token_counts=(tokens - 1,)),
        scheduler=SchedulerState(0, tokens, 0, 0.1),
        step=StepRecord(0, 0, 0, tokens, tokens, 0.01, 1e6, 1e6, 1e3, 100),
    )


def test_a_replay_counts_the_captures_reports_finished_requests_and_tokens(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    finished = EngineRequestRecord(0, "length", 30, 0, 2, 1.0, 1.1, 1.2, 1.3, request_id="req-1")
    health = PublisherHealth(0, 0, 0.001, 3)
    capture = tmp_path / "reports.bin"
    hub_cost.write_messages(
        capture,
        [
            encode(ReportBatch([], health, tiny_engine_facts())),
            encode(ReportBatch([decode_step(4), decode_step(4)], health)),
            encode(ReportBatch([StepReport(finished=(finished,)), decode_step(2)], health)),
        ],
    )
    assert len(hub_cost.read_messages(capture)) == 3
    hub_cost.main(["replay", str(capture), "--repeats", "1", "--profile", "3"])
    printed = capsys.readouterr().out
    assert "3 messages, 4 reports, 1 finished requests, 10 output tokens" in printed
    assert "function calls" in printed  # the profile


def test_a_capture_without_the_cores_facts_is_refused_with_the_reason(tmp_path: Path) -> None:
    capture = tmp_path / "reports.bin"
    hub_cost.write_messages(capture, [encode(ReportBatch([decode_step(4)], PublisherHealth(0, 0, 0.0, 1)))])
    with pytest.raises(SystemExit, match="no message carries the engine core's facts"):
        hub_cost.main(["replay", str(capture)])
