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
    assert serve_ab.main(["ratios", str(kept), "a"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if "median_ttft_ms" in line)
    assert "1.080 (1 of 2)" in line  # the median of 50/55 and 50/40, and A was higher in one round
