"""The stage table: one list that every reader takes the stages from."""

from __future__ import annotations

import itertools
from pathlib import Path

from phasescope.telemetry.request.phases import EngineTimestamps, FrontendTimestamps, PhaseTimings, derive_phase_timings
from phasescope.telemetry.request.stages import ABANDONED, ANSWERED, STAGES

DOCS = Path(__file__).resolve().parents[4] / "docs" / "metrics.md"


def test_the_answered_stages_tile_a_request_end_to_end() -> None:
    # Each stage starts where the one before it ended: no gap, no overlap, entry to last token.
    assert ANSWERED[0].start == "entry"
    assert ANSWERED[-1].end == "last_token_ts"
    for before, after in itertools.pairwise(ANSWERED):
        assert before.end == after.start


def test_each_stage_has_a_unique_name_and_a_timings_field() -> None:
    assert len({stage.name for stage in STAGES}) == len(STAGES)
    fields = set(PhaseTimings.__dataclass_fields__)
    assert {stage.seconds_field for stage in STAGES} <= fields


def test_derivation_gives_each_stage_the_interval_between_its_stamps() -> None:
    front = FrontendTimestamps(entry=10.0, wall_at_entry=0.0, handed_to_engine=10.5, ended=20.0)
    engine = EngineTimestamps(queued_ts=11.0, scheduled_ts=12.5, first_token_ts=14.0, last_token_ts=19.0)
    timings = derive_phase_timings(front, engine, completion_tokens=6)
    assert [timings.seconds(stage) for stage in ANSWERED] == [0.5, 0.5, 1.5, 1.5, 5.0]
    assert timings.seconds(ABANDONED) is None


def test_a_request_without_a_first_token_is_frontend_then_abandoned() -> None:
    front = FrontendTimestamps(entry=10.0, wall_at_entry=0.0, handed_to_engine=10.25, ended=12.0)
    timings = derive_phase_timings(front, None, completion_tokens=0)
    assert {stage.name: timings.seconds(stage) for stage in STAGES if timings.seconds(stage) is not None} == {
        "frontend": 0.25,
        "abandoned": 1.75,
    }


def test_every_stage_is_documented_with_the_phase_label() -> None:
    text = DOCS.read_text()
    for stage in STAGES:
        assert f"`{stage.name}`" in text, f"docs/metrics.md does not describe the {stage.name} stage"
