"""Over-saturation within one run: the server falls further behind the longer the point lasts.

A server that keeps up reaches a steady state after a ramp — requests in flight level off
near rate × E2E (Little's law) and TTFT stops rising — while one that cannot keep up never
does, and a longer point would only measure a longer queue. The check looks at the requests
sent after the ramp: `ramp_seconds`, the median E2E of the first quarter of the requests
(the time the first ones needed to finish, i.e. to fill the pipeline). It flags the run
when either holds:

- **TTFT grows with time**: TTFT against send time has a rising trend (Mann–Kendall, one
  sided, z ≥ `TREND_Z`, i.e. p < 0.01) *and* the later half's median TTFT is at least
  `TTFT_GROWTH_RATIO` × the earlier half's. Both: the test alone flags tiny drifts over
  many requests, the ratio alone flags noise over a few. A rank test rather than a
  least-squares slope, because one slow request does not make a trend.
- **requests queue faster than they finish**: from the end of the ramp to the last send,
  arrivals exceed completions by at least `TREND_Z` standard deviations of what a steady
  state gives, and by at least `BACKLOG_MIN_REQUESTS`. In a steady state the number in
  flight is roughly Poisson (an M/G/∞ picture), so arrivals − completions over a window —
  the change in the number in flight — has a standard deviation of at most √(2 L), L the
  number in flight when the window opens; an overloaded server adds (rate − capacity) ×
  window to it. On a vLLM engine with free batch slots this is the rule that fires first:
  requests join the batch at once (TTFT stays flat) and the batch grows, every step slower.

Fewer than `MIN_REQUESTS` sent after the ramp: not evaluated (too short to tell), never
flagged. A short point only catches clear overload: a rate 20 % over capacity may need
a longer point (more `--requests`) to show.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from phasescope.bench.workload import RequestRecord

TREND_Z = 2.326
"""One-sided 1 % level of the standard normal: the Mann–Kendall z a rising trend must reach."""
TTFT_GROWTH_RATIO = 1.5
"""The later half's median TTFT over the earlier half's that counts as growth."""
BACKLOG_MIN_REQUESTS = 3
"""A backlog must also grow by this many requests (1 → 3 in flight is not a queue)."""
MIN_REQUESTS = 8
"""Requests after the ramp below which the run is too short to judge."""


def mann_kendall_z(values: Sequence[float]) -> float:
    """The Mann–Kendall trend statistic (normal approximation, tie-corrected): > 0 rising, < 0 falling."""
    n = len(values)
    if n < 3:
        return 0.0
    s = sum(
        (values[j] > values[i]) - (values[j] < values[i]) for i in range(n - 1) for j in range(i + 1, n)
    )  # fmt: skip
    ties = sum(t * (t - 1) * (2 * t + 5) for t in Counter(values).values() if t > 1)
    variance = (n * (n - 1) * (2 * n + 5) - ties) / 18
    if variance <= 0 or s == 0:
        return 0.0
    # Continuity correction: S moves in steps of 2.
    return (s - 1 if s > 0 else s + 1) / math.sqrt(variance)


def halves_ratio(values: Sequence[float], floor: float) -> float:
    """The later half's median ÷ the earlier half's, the latter taken as at least `floor` (no division by 0)."""
    middle = len(values) // 2
    return statistics.median(values[middle:]) / max(statistics.median(values[:middle]), floor)


@dataclass
class SaturationCheck:
    over_saturated: bool = False
    evaluated: bool = False
    reasons: list[str] = field(default_factory=list)
    ramp_seconds: float = 0.0
    requests_after_ramp: int = 0
    ttft_trend_z: float = 0.0
    ttft_growth_ratio: float = 1.0
    in_flight_at_ramp_end: int = 0
    backlog_growth: int = 0
    """Arrivals − completions from the end of the ramp to the last send."""
    backlog_z: float = 0.0
    """`backlog_growth` ÷ √(2 × max(1, in flight at the ramp's end))."""

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _in_flight_at(records: Sequence[RequestRecord], moment: float) -> int:
    """Requests sent before `moment` and not yet finished at it."""
    return sum(1 for r in records if r.sent < moment < (r.finished or math.inf))


def check_saturation(records: Sequence[RequestRecord]) -> SaturationCheck:
    check = SaturationCheck()
    by_send = sorted(records, key=lambda r: r.sent)
    if not by_send:
        return check
    first_sent = by_send[0].sent
    quarter = by_send[: max(1, len(by_send) // 4)]
    early_e2e = [r.e2e for r in quarter if r.e2e is not None and not r.error]
    check.ramp_seconds = statistics.median(early_e2e) if early_e2e else 0.0
    after = [r for r in by_send if r.sent - first_sent >= check.ramp_seconds]
    check.requests_after_ramp = len(after)
    if len(after) < MIN_REQUESTS:
        return check
    check.evaluated = True

    ttfts = [r.ttft for r in after if r.ttft is not None and not r.error]
    if len(ttfts) >= MIN_REQUESTS:
        check.ttft_trend_z = mann_kendall_z(ttfts)
        check.ttft_growth_ratio = halves_ratio(ttfts, floor=1e-3)
        if check.ttft_trend_z >= TREND_Z and check.ttft_growth_ratio >= TTFT_GROWTH_RATIO:
            check.reasons.append(
                f"TTFT grows with time (Mann–Kendall z {check.ttft_trend_z:.1f}, "
                f"later half's median {check.ttft_growth_ratio:.1f}× the earlier's)"
            )

    opened, closed = first_sent + check.ramp_seconds, by_send[-1].sent
    check.in_flight_at_ramp_end = _in_flight_at(by_send, opened)
    arrivals = sum(1 for r in by_send if opened < r.sent <= closed)
    completions = sum(1 for r in by_send if opened < r.finished <= closed)
    check.backlog_growth = arrivals - completions
    check.backlog_z = check.backlog_growth / math.sqrt(2 * max(1, check.in_flight_at_ramp_end))
    if check.backlog_z >= TREND_Z and check.backlog_growth >= BACKLOG_MIN_REQUESTS:
        check.reasons.append(
            f"requests queue faster than they finish ({arrivals} sent, {completions} finished after the ramp; "
            f"{check.in_flight_at_ramp_end} in flight at its end, z {check.backlog_z:.1f})"
        )
    check.over_saturated = bool(check.reasons)
    return check
