"""Rounds read: each target ÷ the baseline is the median of the rounds' ratios, paired within a round (and within a
kept result when several are pooled), with a seeded 95 % bootstrap interval; the report and `--pool` print them.
(How a point's rounds run is `test_loop`'s.)"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from phasescope.bench import runner
from phasescope.bench.harness import write_results
from phasescope.bench.report import print_round_ratios, write_report
from phasescope.bench.rounds import ROUND_FIGURES, choose_baseline, collect_rounds, median_interval, round_ratios
from phasescope.cli.main import build_parser


def run(repeat: int, ttft: float, cpu: float | None = 1.0) -> dict[str, Any]:
    figures: dict[str, Any] = dict.fromkeys(ROUND_FIGURES, 1.0)
    figures.update(repeat=repeat, median_ttft_ms=ttft, frontend_cpu_seconds_per_1k_tokens=cpu)
    return figures


def point(target: str, *runs: dict[str, Any], value: float = 64.0) -> dict[str, Any]:
    return {"target": target, "load": "concurrency", "value": value, "runs": list(runs)}


POINTS = [
    point("vllm-grpc", run(0, 50.0), run(1, 50.0), run(2, 60.0, cpu=None)),
    point("phasescope-vllm-grpc", run(0, 55.0), run(1, 40.0)),  # round 3 cut short: no ratio
    point("in-process", run(0, 45.0, cpu=None), run(1, 50.0, cpu=None), run(2, 50.0, cpu=None)),
]


def test_a_rounds_ratio_pairs_the_targets_of_that_round_and_the_median_is_taken_over_the_rounds() -> None:
    by_target = {row["target"]: row for row in round_ratios(collect_rounds([POINTS]), "vllm-grpc")}
    ours = by_target["phasescope-vllm-grpc"]
    assert ours["rounds"] == 2
    ttft = ours["figures"]["median_ttft_ms"]
    assert ttft["ratios"] == pytest.approx([1.1, 0.8])
    assert ttft["median"] == pytest.approx(0.95)
    assert ttft["higher"] == 1
    # No front-end CPU for the in-process target (no process of its own), nor for the baseline in round 3.
    assert "frontend_cpu_seconds_per_1k_tokens" not in by_target["in-process"]["figures"]
    assert by_target["in-process"]["figures"]["median_ttft_ms"]["ratios"] == pytest.approx([0.9, 1.0, 50 / 60])
    (other,) = round_ratios(collect_rounds([POINTS[:2]]), "phasescope-vllm-grpc")
    assert other["figures"]["median_ttft_ms"]["ratios"] == pytest.approx([50 / 55, 1.25])


def test_one_round_beside_the_baseline_has_no_row_and_points_pair_only_with_their_own_load() -> None:
    points = [point("vllm-grpc", run(0, 50.0)), point("phasescope-vllm-grpc", run(0, 55.0)),
              point("vllm-grpc", run(0, 50.0), run(1, 50.0), value=16.0),
              point("phasescope-vllm-grpc", run(0, 40.0), run(1, 45.0), value=16.0)]  # fmt: skip
    (row,) = round_ratios(collect_rounds([points]), "vllm-grpc")
    assert row["value"] == 16.0
    assert row["figures"]["median_ttft_ms"]["ratios"] == pytest.approx([0.8, 0.9])


def test_kept_results_pool_their_rounds_each_paired_within_its_own_result() -> None:
    again = [point("vllm-grpc", run(0, 40.0)), point("phasescope-vllm-grpc", run(0, 36.0))]
    (row,) = [r for r in round_ratios(collect_rounds([POINTS, again]), "vllm-grpc") if r["target"].startswith("p")]
    # Round 0 of each result is its own round: 55/50, 40/50 and 36/40.
    assert row["rounds"] == 3
    assert row["figures"]["median_ttft_ms"]["ratios"] == pytest.approx([1.1, 0.8, 0.9])
    assert row["figures"]["median_ttft_ms"]["median"] == pytest.approx(0.9)


def test_the_medians_interval_narrows_with_more_rounds_holds_the_median_and_is_seeded() -> None:
    spread = [0.9, 1.1, 0.95, 1.05, 1.0, 0.85, 1.15, 1.02]
    few_low, few_high = median_interval(spread)
    many_low, many_high = median_interval(spread * 8)
    assert few_low <= 1.01 <= few_high
    assert many_high - many_low < few_high - few_low
    assert median_interval([1.0] * 5) == (1.0, 1.0)
    assert median_interval(spread) == median_interval(list(spread))


def test_the_baseline_is_vllms_grpc_worker_when_it_runs_else_the_first_target() -> None:
    assert choose_baseline(["in-process", "vllm-openai", "phasescope", "vllm-grpc"]) == "vllm-grpc"
    assert choose_baseline(["phasescope", "before"]) == "phasescope"
    assert choose_baseline(["phasescope", "before"], "before") == "before"
    assert choose_baseline(["phasescope"]) is None


def test_the_report_and_the_printout_carry_each_ratio_with_its_interval(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = round_ratios(collect_rounds([POINTS]), "vllm-grpc")
    print_round_ratios(rows)
    out = capsys.readouterr().out
    assert "Each target ÷ vllm-grpc, round by round" in out
    line = next(line for line in out.splitlines() if line.startswith("| phasescope-vllm-grpc"))
    low, high = rows[0]["figures"]["median_ttft_ms"]["low"], rows[0]["figures"]["median_ttft_ms"]["high"]
    assert f"| 0.950 [{low:.3f}–{high:.3f}] (1) |" in line
    results = {"command": "phasescope bench", "started": "2026-12-04T00:00:00+00:00", "parameters": {"repeats": 3,
               "requests": 2}, "formulas": {}, "slo": {}, "points": [], "plans": [], "round_ratios": rows}  # fmt: skip
    report = write_report(results, [], tmp_path).read_text()
    assert "## Each target beside the baseline, round by round" in report
    assert line in report


def test_pool_reads_kept_results_and_prints_their_rounds_pooled(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first, again = tmp_path / "a" / "bench.json.gz", tmp_path / "b" / "bench.json.gz"
    write_results(first, {"baseline": "vllm-grpc", "points": POINTS})
    write_results(again, {"points": [point("vllm-grpc", run(0, 40.0)), point("phasescope-vllm-grpc", run(0, 36.0))]})
    assert json.loads(gzip.decompress(first.read_bytes()))["baseline"] == "vllm-grpc"
    assert runner.main(build_parser().parse_args(["bench", "--pool", str(first), str(again)])) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| phasescope-vllm-grpc"))
    assert "| 3 | 1.000" in line
    assert "| 0.900 [" in line
    args = build_parser().parse_args(["bench", "--pool", str(first), "--baseline", "nobody"])
    assert runner.main(args) == 2
