"""Each target beside a baseline, round by round: the median of the rounds' ratios and its 95 % bootstrap interval.

A round is one repeat of a point: every target runs once on the same seeded prompts, back to back,
the order reversed every other round (`loop.Bench.point`). Whatever the machine does between rounds
(a neighbour's load, a clock that drifts, a cache that fills) lands on both sides of a round alike,
so a round's ratio is steadier than a ratio of the targets' medians. A figure here is the median of
the rounds' ratios, how many rounds the target's figure was the higher in, and a 95 % bootstrap
interval of that median (rounds resampled with replacement, seeded): how far the rounds kept pin it
down. How closely that resolves a difference on the development machine: docs/benchmarks.md, "How to compare:
one command, alternating rounds, intervals".
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

ROUND_FIGURES = (
    "output_throughput",
    "median_ttft_ms",
    "median_tpot_ms",
    "frontend_cpu_seconds_per_1k_tokens",
)
"""The figures set beside the baseline's: output tokens/s, TTFT p50, TPOT p50, front-end CPU per 1,000 tokens."""

PREFERRED_BASELINES = ("vllm-grpc", "vllm-rust")
"""vLLM's own workers, the baseline when measured (its Python servicer first)."""
"""vLLM's own gRPC worker, the baseline whenever it is measured."""

Rounds = dict[tuple[str, float], dict[tuple[int, int], dict[str, dict[str, Any]]]]
"""(load, value) → (kept result, round) → target → that run's figures."""


def choose_baseline(targets: Sequence[str], requested: str | None = None) -> str | None:
    """The target the others are divided by: `requested` when given, else vLLM's gRPC worker when measured, else
    the first target; None when fewer than two targets ran."""
    if requested is not None:
        return requested
    if len(targets) < 2:
        return None
    preferred = [name for name in PREFERRED_BASELINES if name in targets]
    return preferred[0] if preferred else targets[0]


def median_interval(ratios: Sequence[float], resamples: int = 4000, seed: int = 0) -> tuple[float, float]:
    """A 95 % bootstrap interval of the median of `ratios`: the rounds resampled with replacement (seeded, so
    the same rounds give the same interval), the 2.5th and 97.5th percentiles of the resamples' medians."""
    draws = np.random.default_rng(seed).choice(np.asarray(ratios, dtype=float), size=(resamples, len(ratios)))
    low, high = np.percentile(np.median(draws, axis=1), [2.5, 97.5])
    return float(low), float(high)


def collect_rounds(kept: Sequence[Iterable[dict[str, Any]]]) -> Rounds:
    """Every run of every point, by (load, value), round and target, from one bench's points or several kept
    results' (pooled: each result's rounds numbered apart, so a round pairs the targets of one result only)."""
    rounds: Rounds = {}
    for number, points in enumerate(kept):
        for point in points:
            by_round = rounds.setdefault((point["load"], point["value"]), {})
            for figures in point.get("runs", []):
                by_round.setdefault((number, figures["repeat"]), {})[point["target"]] = figures
    return rounds


def _figure(ratios: list[float]) -> dict[str, Any]:
    low, high = median_interval(ratios)
    return {
        "median": statistics.median(ratios),
        "low": low,
        "high": high,
        "higher": sum(ratio > 1 for ratio in ratios),
        "ratios": ratios,
    }


def round_ratios(rounds: Rounds, baseline: str) -> list[dict[str, Any]]:
    """Each target ÷ `baseline` at each point both ran, per figure over the rounds both ran: the median of the
    rounds' ratios, its interval, how many rounds the target's figure was the higher, and the ratios in order.
    A round where the baseline's figure is 0 or absent (no front-end CPU for an in-process target) has no ratio;
    a target beside the baseline in fewer than two rounds has no row."""
    table = []
    for (load, value), by_round in rounds.items():
        paired = [sides for _, sides in sorted(by_round.items()) if baseline in sides]
        targets = list(dict.fromkeys(name for sides in paired for name in sides if name != baseline))
        for target in targets:
            both = [(sides[target], sides[baseline]) for sides in paired if target in sides]
            if len(both) < 2:  # one ratio has no interval: the point's own figures say as much
                continue
            figures = {}
            for figure in ROUND_FIGURES:
                ratios = [ours[figure] / theirs[figure] for ours, theirs in both
                          if ours.get(figure) is not None and theirs.get(figure)]  # fmt: skip
                if ratios:
                    figures[figure] = _figure(ratios)
            if figures:
                table.append({"target": target, "baseline": baseline, "load": load, "value": value,
                              "rounds": len(both), "figures": figures})  # fmt: skip
    return table
