"""serve_ab's reading of its rounds: each round's ratio, paired by round, and a kept run read again."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtests import serve_ab
from phasescope.bench.harness import write_results


def result(round_: int, config: str, ttft: float) -> dict[str, object]:
    figures: dict[str, object] = dict.fromkeys(serve_ab.FIGURES, 1.0)
    return {"round": round_, "config": config, **figures, "median_ttft_ms": ttft}


ROUNDS = [
    result(1, "a", 50.0),
    result(1, "b", 55.0),
    result(2, "b", 40.0),  # B ran first in even rounds
    result(2, "a", 50.0),
    result(3, "a", 60.0),  # a round cut short: no B, no ratio
]


def test_each_round_s_ratio_pairs_the_sides_of_that_round() -> None:
    ratios = serve_ab.round_ratios(ROUNDS)
    assert ratios["median_ttft_ms"] == pytest.approx([1.1, 0.8])
    assert serve_ab.round_ratios(ROUNDS, "a")["median_ttft_ms"] == pytest.approx([50 / 55, 1.25])


def test_a_kept_run_is_read_again_side_over_side(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    kept = tmp_path / "rounds.json.gz"
    write_results(kept, {"rounds": ROUNDS})
    assert serve_ab.main(["ratios", f"{kept}:a"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if "median_ttft_ms" in line)
    assert "1.080 (1 of 2)" in line  # the median of 50/55 and 50/40, and A was higher in one round


def test_runs_with_the_places_swapped_are_pooled_by_the_side_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first, swapped = tmp_path / "first.json.gz", tmp_path / "swapped.json"
    write_results(first, {"rounds": ROUNDS})
    # The same server in the other place: its figures under "b" now.
    write_results(swapped, {"rounds": [result(1, "a", 40.0), result(1, "b", 36.0)]})
    assert serve_ab.main(["ratios", f"{first}:a", f"{swapped}:b"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if "median_ttft_ms" in line)
    assert "0.909 (1 of 3)" in line  # 50/55, 50/40 and 36/40, round 1 of each run paired within its run


def test_the_median_s_interval_narrows_with_more_rounds_and_holds_the_median() -> None:
    spread = [0.9, 1.1, 0.95, 1.05, 1.0, 0.85, 1.15, 1.02]
    few_low, few_high = serve_ab.median_interval(spread)
    many_low, many_high = serve_ab.median_interval(spread * 8)
    assert few_low <= 1.01 <= few_high
    assert many_high - many_low < few_high - few_low
    assert serve_ab.median_interval([1.0] * 5) == (1.0, 1.0)
