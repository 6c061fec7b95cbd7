"""One run's statistics: vLLM bench-serve summaries and percentiles (the server's view is in `hardware`).

`ratios` then sets phasescope beside the other targets at every point.
"""

from __future__ import annotations

import statistics
from typing import Any

from phasescope.bench.workload import RequestRecord
from phasescope.telemetry.live import percentile

FORMULAS = {
    "ttft": "TTFT = first streamed token − send",
    "tpot": "TPOT = (E2E − TTFT) ÷ (output tokens − 1), per request",
    "itl": "ITL = each gap between consecutive token arrivals, pooled",
    "e2el": "E2E = last token − send",
    "output_throughput": "Σ output tokens ÷ duration",
    "request_throughput": "completed requests ÷ duration",
    "total_token_throughput": "Σ (prompt + output tokens) ÷ duration",
    "frontend_cpu_seconds_per_1k_tokens": "front-end process user+system CPU seconds ÷ (streamed tokens ÷ 1000)",
    "goodput_ratio": "requests that completed and met every --slo objective ÷ requests sent",
    "request_goodput": "requests that met every --slo objective ÷ duration",
    "output_goodput": "Σ output tokens of the requests that met every --slo objective ÷ duration",
    "tokens_per_second_per_user": "1000 ÷ median TPOT (ms): the decode speed one stream sees",
    "server_device_bandwidth_saturation": "bytes the model moved ÷ duration ÷ peak memory bandwidth (MBU)",
    "server_device_compute_utilization": "model FLOPs ÷ duration ÷ peak FLOP/s (MFU); idleness = 1 − MFU",
    "speculative_acceptance_rate": "Δ accepted tokens ÷ Δ drafted tokens over the run, from the server's "
    "speculative decoding counters (phasescope_speculative_*, else vllm:spec_decode_*); absent without them",
    "speculative_mean_acceptance_length": "1 + Δ accepted tokens ÷ Δ drafts: tokens a sequence emits per verify step",
    "spread": "median, min and max of each figure over the point's repeats (each its own seed)",
}


def _percentiles(prefix: str, values_seconds: list[float]) -> dict[str, float]:
    if not values_seconds:
        return {f"{kind}_{prefix}_ms": 0.0 for kind in ("mean", "median", "std", "p90", "p95", "p99", "max")}
    ms = [v * 1e3 for v in values_seconds]
    return {
        f"mean_{prefix}_ms": statistics.fmean(ms),
        f"median_{prefix}_ms": percentile(ms, 50),
        f"std_{prefix}_ms": statistics.pstdev(ms),
        f"p90_{prefix}_ms": percentile(ms, 90),
        f"p95_{prefix}_ms": percentile(ms, 95),
        f"p99_{prefix}_ms": percentile(ms, 99),
        f"max_{prefix}_ms": max(ms),
    }


def summarize(records: list[RequestRecord], duration: float) -> dict[str, Any]:
    done = [r for r in records if not r.error and r.token_times]
    output = sum(r.output_tokens for r in done)
    prompt = sum(r.prompt_tokens for r in done)
    ttfts = [r.ttft for r in done if r.ttft is not None]
    tpots = [r.tpot for r in done if r.tpot is not None]
    itls = [b - a for r in done for a, b in zip(r.token_times, r.token_times[1:], strict=False) if b > a]
    e2es = [r.e2e for r in done if r.e2e is not None]
    summary: dict[str, Any] = {
        "completed": len(done),
        "errors": len([r for r in records if r.error]),
        "failed": len([r for r in records if r.error]),
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
    summary["tokens_per_second_per_user"] = 1e3 / summary["median_tpot_ms"] if summary["median_tpot_ms"] else 0.0
    return summary


# Each phasescope target and the peers it is compared with, point by point.
_PEERS = {
    "phasescope": ("in-process", "vllm-openai"),
    "phasescope-vllm-grpc": ("vllm-grpc",),
}


def ratios(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each phasescope target ÷ its peers, per point: phasescope.v1 ÷ in-process and ÷ vLLM's OpenAI server,
    and phasescope over vLLM's engine protocol ÷ vLLM's own gRPC worker."""
    table = []
    by = {(r["target"], r["load"], r["value"]): r for r in results}
    for (target, load, value), ours in sorted(by.items()):
        peers = _PEERS.get(target)
        if peers is None:
            continue
        row: dict[str, Any] = {"target": target, "load": load, "value": value}
        cpu = ours.get("frontend_cpu_seconds_per_1k_tokens")
        for other in peers:
            theirs = by.get((other, load, value))
            if not theirs:
                continue
            if theirs["output_throughput"]:
                row[f"throughput_vs_{other}"] = ours["output_throughput"] / theirs["output_throughput"]
                row[f"median_ttft_ms_minus_{other}"] = ours["median_ttft_ms"] - theirs["median_ttft_ms"]
            if theirs["median_ttft_ms"]:
                row[f"median_ttft_vs_{other}"] = ours["median_ttft_ms"] / theirs["median_ttft_ms"]
            their_cpu = theirs.get("frontend_cpu_seconds_per_1k_tokens")
            if cpu is not None and their_cpu:
                row[f"frontend_cpu_vs_{other}"] = cpu / their_cpu
        table.append(row)
    return table
