"""The SLA search: the highest load (Poisson rate or concurrency) whose goodput ratio stays at the target.

A bracketing search over a curve assumed monotone (more load never raises the goodput
ratio), driven one point at a time so the caller can interleave targets and repeats:

1. run `start`; while points pass, multiply the load by `factor` (expand up) until one
   fails — or, when `start` itself fails, divide by `factor` (expand down) until one passes;
2. bisect between the highest passing and the lowest failing load until the bracket is
   narrow enough (`tolerance` of its lower end; width 1 for concurrency) or the
   `max_points` budget is spent.

The answer is the highest passing load, with its bracket [last passing, first failing]:
the true limit lies inside it (to the precision the repeats allow). `status` says when
it is only a bound: `never_failed` (every point passed: the answer is a lower bound) or
`never_passed` (even the lowest load tried failed: the limit is below it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MIN_RATE = 1e-3
"""Expanding down stops here (requests/s): a rate this low means the server cannot meet the SLO at all."""


@dataclass
class BracketSearch:
    start: float
    max_points: int
    integer: bool = False
    """Concurrency: whole loads ≥ 1, bisection down to a bracket of width 1."""
    factor: float = 2.0
    tolerance: float = 0.1
    """Bisection stops when (first failing − last passing) ≤ tolerance × last passing."""
    passing: float | None = None
    failing: float | None = None
    tried: list[tuple[float, bool]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.integer:
            self.start = float(max(1, round(self.start)))
        if not (self.start > 0 and self.max_points >= 1 and self.factor > 1 and self.tolerance > 0):
            raise ValueError("a search needs start > 0, max_points ≥ 1, factor > 1 and tolerance > 0")

    def _narrow_enough(self, low: float, high: float) -> bool:
        return high - low <= 1 if self.integer else high - low <= self.tolerance * low

    def next_load(self) -> float | None:
        """The next load to run, or None when the search is over."""
        if len(self.tried) >= self.max_points:
            return None
        if not self.tried:
            return self.start
        if self.failing is None:
            assert self.passing is not None
            up = self.passing * self.factor
            return float(max(self.passing + 1, round(up))) if self.integer else up
        if self.passing is None:
            if self.integer:
                # Nothing below concurrency 1.
                return None if self.failing <= 1 else float(max(1, int(self.failing / self.factor)))
            down = self.failing / self.factor
            return down if down >= MIN_RATE else None
        if self._narrow_enough(self.passing, self.failing):
            return None
        middle = (self.passing + self.failing) / 2
        return float(int(middle)) if self.integer else middle

    def record(self, load: float, passed: bool) -> None:
        self.tried.append((load, passed))
        if passed and (self.passing is None or load > self.passing):
            self.passing = load
        if not passed and (self.failing is None or load < self.failing):
            self.failing = load

    @property
    def status(self) -> str:
        if self.passing is None:
            return "never_passed"
        if self.failing is None:
            return "never_failed"
        return "bracketed"

    @property
    def bracket(self) -> tuple[float | None, float | None]:
        """[last passing, first failing]: the limit lies between them."""
        return self.passing, self.failing

    def result(self) -> dict[str, Any]:
        """The answer (highest passing load), its bracket, how the search ended and every point it ran."""
        return {
            "answer": self.passing,
            "bracket": list(self.bracket),
            "status": self.status,
            "points_run": len(self.tried),
            "max_points": self.max_points,
            "converged": self.status == "bracketed" and self._narrow_enough(self.passing or 0.0, self.failing or 0.0),
            "tried": [{"load": load, "passed": passed} for load, passed in self.tried],
        }
