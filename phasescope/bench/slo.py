"""Service-level objectives and goodput: which requests met every objective, and what they add up to.

Goodput as vLLM's `bench serve --goodput` defines it (after DistServe): a request is good when
it completed and met every objective given; `request_goodput` = good requests ÷ duration. A
request with fewer than two output tokens has no TPOT and meets a TPOT objective (vLLM counts
its TPOT as 0). A failed request is never good, and it counts in the ratio's denominator:
`goodput_ratio` = good requests ÷ requests sent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from phasescope.bench.workload import RequestRecord

OBJECTIVES = ("ttft_ms", "tpot_ms", "e2e_ms")


class SloError(ValueError):
    """A `--slo` value that is not `name=milliseconds[,...]` over the known objectives."""


def parse_slo(text: str) -> dict[str, float]:
    """`ttft_ms=2000,tpot_ms=150` → {"ttft_ms": 2000.0, "tpot_ms": 150.0}; any subset of `OBJECTIVES`."""
    slo: dict[str, float] = {}
    for item in text.split(","):
        name, equals, value = (part.strip() for part in item.partition("="))
        if not name and not equals:
            raise SloError(f"empty objective in {text!r} (expected e.g. ttft_ms=2000,tpot_ms=150)")
        if not equals:
            raise SloError(f"{item.strip()!r} has no '=' (expected e.g. ttft_ms=2000)")
        if name not in OBJECTIVES:
            raise SloError(f"unknown objective {name!r} (use {', '.join(OBJECTIVES)})")
        if name in slo:
            raise SloError(f"{name} given twice")
        try:
            milliseconds = float(value)
        except ValueError:
            raise SloError(f"{name}={value!r} is not a number of milliseconds") from None
        if not milliseconds > 0 or milliseconds == float("inf"):
            raise SloError(f"{name} must be a positive, finite number of milliseconds, got {value!r}")
        slo[name] = milliseconds
    return slo


def _measured_ms(record: RequestRecord) -> dict[str, float] | None:
    if record.error or record.ttft is None or record.e2e is None:
        return None
    return {"ttft_ms": record.ttft * 1e3, "tpot_ms": (record.tpot or 0.0) * 1e3, "e2e_ms": record.e2e * 1e3}


def meets(record: RequestRecord, slo: Mapping[str, float]) -> bool:
    """Whether a request completed and met every objective in `slo`."""
    measured = _measured_ms(record)
    return measured is not None and all(measured[name] <= bound for name, bound in slo.items())


def goodput(records: Sequence[RequestRecord], duration: float, slo: Mapping[str, float]) -> dict[str, Any]:
    """The goodput figures of one run; empty without objectives."""
    if not slo:
        return {}
    good = [r for r in records if meets(r, slo)]
    figures: dict[str, Any] = {
        "slo_met": len(good),
        "goodput_ratio": len(good) / len(records) if records else 0.0,
        "request_goodput": len(good) / duration if duration > 0 else 0.0,
        "output_goodput": sum(r.output_tokens for r in good) / duration if duration > 0 else 0.0,
    }
    # Each objective on its own, to see which one a failing point misses.
    for name in slo:
        met = [r for r in records if meets(r, {name: slo[name]})]
        figures[f"slo_{name}_met_ratio"] = len(met) / len(records) if records else 0.0
    return figures
