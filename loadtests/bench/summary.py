"""One point's statistics: vLLM bench-serve summaries and percentiles, and the server's own view from /metrics.

`ratios` then sets phasescope beside the other targets at every point.
"""

from __future__ import annotations

import statistics
from typing import Any

from loadtests.bench.workload import RequestRecord
from telemetry.exposition import Samples, sum_samples

FORMULAS = {
    "ttft": "TTFT = first streamed token − send",
    "tpot": "TPOT = (E2E − TTFT) ÷ (output tokens − 1), per request",
    "itl": "ITL = each gap between consecutive token arrivals, pooled",
    "e2el": "E2E = last token − send",
    "output_throughput": "Σ output tokens ÷ duration",
    "request_throughput": "completed requests ÷ duration",
    "total_token_throughput": "Σ (prompt + output tokens) ÷ duration",
    "frontend_cpu_seconds_per_1k_tokens": "front-end process user+system CPU seconds ÷ (streamed tokens ÷ 1000)",
}


def _percentiles(prefix: str, values_seconds: list[float]) -> dict[str, float]:
    if not values_seconds:
        return {f"{kind}_{prefix}_ms": 0.0 for kind in ("mean", "median", "std", "p90", "p95", "p99", "max")}
    ms = sorted(v * 1e3 for v in values_seconds)

    def pct(p: float) -> float:
        return ms[min(len(ms) - 1, round(p / 100 * (len(ms) - 1)))]

    return {
        f"mean_{prefix}_ms": statistics.fmean(ms),
        f"median_{prefix}_ms": statistics.median(ms),
        f"std_{prefix}_ms": statistics.pstdev(ms),
        f"p90_{prefix}_ms": pct(90),
        f"p95_{prefix}_ms": pct(95),
        f"p99_{prefix}_ms": pct(99),
        f"max_{prefix}_ms": ms[-1],
    }


def summarize(records: list[RequestRecord], duration: float) -> dict[str, Any]:
    done = [r for r in records if not r.error and r.token_times]
    output = sum(r.output_tokens for r in done)
    prompt = sum(r.prompt_tokens for r in done)
    ttfts = [r.ttft for r in done if r.ttft is not None]
    tpots = [
        (r.e2e - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1 and r.e2e and r.ttft is not None
    ]
    itls = [b - a for r in done for a, b in zip(r.token_times, r.token_times[1:], strict=False) if b > a]
    e2es = [r.e2e for r in done if r.e2e is not None]
    summary: dict[str, Any] = {
        "completed": len(done),
        "errors": len([r for r in records if r.error]),
        "timeouts": len([r for r in records if "Timeout" in r.error or "DEADLINE" in r.error]),
        "duration": duration,
        "total_input_tokens": prompt,
        "total_output_tokens": output,
        "request_throughput": len(done) / duration,
        "output_throughput": output / duration,
        "total_token_throughput": (output + prompt) / duration,
    }
    for prefix, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2es)):
        summary.update(_percentiles(prefix, values))
    return summary


def server_view(before: Samples, after: Samples, duration: float) -> dict[str, float]:
    """The server's own account of the same window, from counter deltas."""

    def delta(name: str, **labels: str) -> float:
        return sum_samples(after, name, **labels) - sum_samples(before, name, **labels)

    view: dict[str, float] = {}
    for phase in ("frontend", "queue", "prefill", "decode"):
        count = delta("phasescope_request_phase_seconds_count", phase=phase)
        total = delta("phasescope_request_phase_seconds_sum", phase=phase)
        view[f"server_mean_{phase}_ms"] = total / count * 1e3 if count else 0.0
    view["server_requests_without_first_token"] = delta("phasescope_requests_without_first_token_total")
    peak_bandwidth = sum_samples(after, "phasescope_hardware_peak_memory_bandwidth_bytes_per_second")
    peak_flops = sum_samples(after, "phasescope_hardware_peak_flops_per_second")
    # Over the point's wall time, per engine average (peaks are per engine).
    engines = max(1, len({dict(ls).get("engine") for (n, ls) in after if n == "phasescope_engine_requests"}))

    def bandwidth_saturation(moved: float) -> float:
        return moved / duration / engines / peak_bandwidth if peak_bandwidth else 0.0

    def compute_utilization(flops: float) -> float:
        return flops / duration / engines / peak_flops if peak_flops else 0.0

    device_moved = device_flops = 0.0
    for phase in ("prefill", "decode"):
        view[f"server_{phase}_tokens_per_second"] = delta("phasescope_tokens_total", phase=phase) / duration
        moved = delta("phasescope_model_read_bytes_total", phase=phase) + delta(
            "phasescope_model_written_bytes_total", phase=phase
        )
        flops = delta("phasescope_model_flops_total", phase=phase)
        device_moved, device_flops = device_moved + moved, device_flops + flops
        # Each phase's part of the device's figures (docs/metrics.md).
        view[f"server_{phase}_bandwidth_saturation"] = bandwidth_saturation(moved)
        view[f"server_{phase}_compute_utilization"] = compute_utilization(flops)
    view["server_device_bandwidth_saturation"] = bandwidth_saturation(device_moved)
    # Compute idleness is the device's: 1 − MFU of all steps.
    view["server_device_compute_idleness"] = 1.0 - compute_utilization(device_flops)
    return view


def ratios(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """phasescope ÷ in-process and ÷ vLLM's OpenAI server, per point."""
    table = []
    by = {(r["target"], r["load"], r["value"]): r for r in results}
    for (target, load, value), ours in sorted(by.items()):
        if target != "phasescope":
            continue
        row: dict[str, Any] = {"load": load, "value": value}
        for other in ("in-process", "vllm-openai"):
            theirs = by.get((other, load, value))
            if theirs and theirs["output_throughput"]:
                row[f"throughput_vs_{other}"] = ours["output_throughput"] / theirs["output_throughput"]
                row[f"median_ttft_ms_minus_{other}"] = ours["median_ttft_ms"] - theirs["median_ttft_ms"]
        cpu = ours.get("frontend_cpu_seconds_per_1k_tokens")
        openai = by.get(("vllm-openai", load, value), {}).get("frontend_cpu_seconds_per_1k_tokens")
        if cpu is not None and openai:
            row["frontend_cpu_vs_vllm-openai"] = cpu / openai
        table.append(row)
    return table
