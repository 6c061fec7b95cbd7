"""A bench run from the command line's arguments: the sweeps, bench.json, the plots and the printed tables."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import asdict
from typing import Any

from loadtests.bench.launch import default_settings, start_in_process, start_openai, start_phasescope
from loadtests.bench.loop import sweep
from loadtests.bench.plots import plot
from loadtests.bench.summary import FORMULAS, ratios
from loadtests.bench.targets import PhasescopeTarget
from loadtests.harness import StartError


async def run(args: argparse.Namespace) -> dict[str, Any]:
    points = [("concurrency", float(c)) for c in args.concurrency.split(",") if c.strip()]
    points += [("rate", float(r)) for r in args.rates.split(",") if r.strip()]
    if not points or any(value <= 0 for _, value in points) or args.requests < 1:
        raise SystemExit(
            "phasescope bench: give at least one positive --concurrency or --rates point and --requests ≥ 1"
        )
    args.output_dir.mkdir(parents=True, exist_ok=True)
    settings = default_settings(args)
    results: list[dict[str, Any]] = []
    # One engine at a time: on a small machine two engines would measure each other.
    if args.compare:
        llm, in_process = start_in_process(settings)
        try:
            await sweep(in_process, points, args, results)
        finally:
            llm.shutdown()
        server, openai = start_openai(settings, args.output_dir)
        try:
            await sweep(openai, points, args, results)
        finally:
            await openai.close()
            server.stop()
    if args.address:
        await sweep(PhasescopeTarget(args.address, args.metrics_url, None), points, args, results)
    else:
        phasescope, ours = start_phasescope(settings, args.output_dir / "phasescope.log")
        try:
            await sweep(ours, points, args, results)
        finally:
            phasescope.stop()
    return {"settings": asdict(settings), "formulas": FORMULAS, "points": results, "ratios": ratios(results)}


def main(args: argparse.Namespace) -> int:
    """`phasescope bench` (its flags are defined by `server.commands.bench`)."""
    try:
        report = asyncio.run(run(args))
    except StartError as exc:  # a server that did not start is the operator's problem, not a traceback
        raise SystemExit(str(exc)) from exc
    path = args.output_dir / "bench.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    plots = plot(report["points"], args.output_dir)
    print("\n" + "\n".join(f"  {value}" for value in FORMULAS.values()))
    columns = ("target", "load", "value", "output_throughput", "request_throughput", "median_ttft_ms", "p99_ttft_ms",
               "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "median_e2el_ms", "errors")  # fmt: skip
    print("| " + " | ".join(columns) + " | front-end CPU s/1k tok |")
    print("|" + "---|" * (len(columns) + 1))
    for point in report["points"]:
        cells = [f"{point[c]:.2f}" if isinstance(point[c], float) else str(point[c]) for c in columns]
        cpu = point.get("frontend_cpu_seconds_per_1k_tokens")
        print("| " + " | ".join(cells) + f" | {cpu:.3f} |" if cpu is not None else "| " + " | ".join(cells) + " | — |")
    for row in report["ratios"]:
        print("ratios " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
    print(f"results: {path}; plots: {', '.join(str(p) for p in plots)}", file=sys.stderr)
    return 0
