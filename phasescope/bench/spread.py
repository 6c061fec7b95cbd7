"""A point's figures over its repeats: the median of each, and its minimum and maximum.

Each repeat is a full run of the point with its own seed (its own prompts and arrival
times). A point reports, under the same field names as one run (vLLM's), the median over
its repeats, and under `spread` the median, min and max of every numeric figure: the
min–max range is the run-to-run spread the figure carries, not a confidence interval.
Verdicts (strings) take the most frequent value over the repeats.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from typing import Any


def spread(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def most_frequent(values: Sequence[str]) -> str:
    """The most frequent value; a tie goes to the one seen last."""
    counts = Counter(values)
    best = max(counts.values())
    return next(value for value in reversed(values) if counts[value] == best)


def combine_runs(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One point from its runs' figures: medians under the runs' names, and `spread` of every number.

    A figure missing from some runs (a server figure a run could not read) is combined over
    the runs that have it.
    """
    names = list(dict.fromkeys(name for run in runs for name in run))
    point: dict[str, Any] = {}
    table: dict[str, dict[str, float]] = {}
    for name in names:
        values = [run[name] for run in runs if name in run]
        if all(isinstance(v, bool) for v in values):
            continue
        if all(isinstance(v, int | float) for v in values):
            table[name] = spread(values)
            point[name] = table[name]["median"]
        elif all(isinstance(v, str) for v in values):
            point[name] = most_frequent(values)
    point["spread"] = table
    return point
