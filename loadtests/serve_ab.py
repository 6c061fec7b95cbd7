"""Two phasescope configurations side by side: the same load, alternating rounds, throughput and front-end CPU.

A change to the front end (an event loop, a flag, a preloaded allocator) is judged here against
the configuration it replaces, both servers up at once on the same engine settings, the load
alternating between them round by round so machine drift hits both alike:

    .venv/bin/python -m loadtests.serve_ab --tiny-model --a-args "--event-loop asyncio" \\
        --b-args "--event-loop uvloop" --concurrency 64 --requests 256 --max-tokens 128 --rounds 3

Each round is one closed-loop run of `--requests` seeded requests (the same prompts on A and
B in a round). Printed per round and as medians: output tokens/s, TPOT p50, TTFT p50 and the
front-end process's CPU seconds per 1,000 streamed tokens (user + system of the serving
process only, not its engine core), then B ÷ A. `--a-env`/`--b-env` set environment variables
of one server (e.g. LD_PRELOAD); `--a-token-ids-only`/`--b-token-ids-only` make one side's requests
ask for token ids without text. Raw rounds go to --output.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shlex
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import psutil

from phasescope.bench.harness import PhasescopeProcess, stop_on_sigterm, write_results
from phasescope.bench.loop import run_point
from phasescope.bench.summary import summarize
from phasescope.bench.targets import PhasescopeTarget
from phasescope.bench.workload import LengthDistribution, WorkloadSpec, derive_seed, workload

FIGURES = ("output_throughput", "median_tpot_ms", "median_ttft_ms", "frontend_cpu_seconds_per_1k_tokens")


def _cpu(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def _env(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"serve_ab: --a-env/--b-env take NAME=VALUE, got {pair!r}")
        env[name] = value
    return env


async def _round(
    target: PhasescopeTarget, pid: int, spec: WorkloadSpec, seed: int, args: argparse.Namespace
) -> dict[str, Any]:
    requests = workload(spec, seed, args.requests)
    before = _cpu(pid)
    if args.bursts:
        records, duration = await run_point(target, requests, concurrency=None, rate=None, seed=seed,
                                            progress=lambda: None, burst=args.bursts)  # fmt: skip
    else:
        records, duration = await run_point(target, requests, concurrency=args.concurrency, rate=None, seed=seed,
                                            progress=lambda: None)  # fmt: skip
    cpu = _cpu(pid) - before
    summary = summarize(records, duration)
    summary["frontend_cpu_seconds_per_1k_tokens"] = cpu / (summary["total_output_tokens"] / 1e3)
    return {key: summary[key] for key in (*FIGURES, "total_output_tokens", "errors", "duration")}


async def _measure(servers: dict[str, PhasescopeProcess], args: argparse.Namespace) -> list[dict[str, Any]]:
    spec = WorkloadSpec(LengthDistribution.parse(args.prompt_tokens), LengthDistribution.parse(str(args.max_tokens)))
    ids_only = {"a": args.a_token_ids_only, "b": args.b_token_ids_only}
    targets = {name: PhasescopeTarget(server.address, None, server.process.pid, token_ids_only=ids_only[name])
               for name, server in servers.items()}  # fmt: skip
    rounds: list[dict[str, Any]] = []
    try:
        warm = workload(spec, 1, 16)
        for target in targets.values():
            await run_point(target, warm, concurrency=8, rate=None, seed=1, progress=lambda: None)
        for index in range(args.rounds):
            seed = derive_seed(args.seed, 0, index)
            # A first in odd rounds, B first in even ones: neither always runs on a warmer machine.
            order = ["a", "b"] if index % 2 == 0 else ["b", "a"]
            for name in order:
                result = await _round(targets[name], servers[name].process.pid, spec, seed, args)
                rounds.append({"round": index + 1, "config": name, **result})
                print(
                    f"round {index + 1} {name}: {result['output_throughput']:8.1f} tok/s  "
                    f"TPOT p50 {result['median_tpot_ms']:6.1f} ms  TTFT p50 {result['median_ttft_ms']:7.1f} ms  "
                    f"front-end CPU {result['frontend_cpu_seconds_per_1k_tokens']:.4f} s/1k tok  "
                    f"errors {result['errors']}",
                    flush=True,
                )
    finally:
        for target in targets.values():
            await target.close()
    return rounds


def main(argv: list[str] | None = None) -> int:
    stop_on_sigterm()  # the servers and engines it starts are stopped on SIGTERM too
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--a-args", default="", help="serve flags of configuration A (shell-quoted)")
    parser.add_argument("--b-args", default="", help="serve flags of configuration B")
    parser.add_argument("--a-env", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--b-env", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--a-token-ids-only", action="store_true", help="A's requests ask for token ids only")
    parser.add_argument("--b-token-ids-only", action="store_true", help="B's requests ask for token ids only")
    parser.add_argument("--tiny-model", action="store_true", help="serve the tiny model (else the default)")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--bursts", type=int, default=0, help="waves of N at once instead of a closed loop")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", default="uniform:20:60")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, help="raw rounds as JSON, gzipped if it ends in .gz")
    args = parser.parse_args(argv)

    engine = ["--enforce-eager", "--dtype", "float32", "--max-model-len", "2048", "--kv-cache-gib", "2",
              "--max-concurrent-requests", str(max(args.concurrency, args.bursts, 16)),
              "--max-queued-requests", "4096"]  # fmt: skip
    if args.tiny_model:
        from phasescope.bench.tiny_model import ensure_tiny_model

        engine += ["--model", str(ensure_tiny_model())]
    logs = Path(tempfile.mkdtemp(prefix="serve-ab-"))
    with contextlib.ExitStack() as stack:
        servers = {}
        for name, extra, env in (("a", args.a_args, args.a_env), ("b", args.b_args, args.b_env)):
            server = PhasescopeProcess([*engine, *shlex.split(extra)], logs / f"{name}.log", env=_env(env))
            stack.callback(server.stop)
            servers[name] = server
        for server in servers.values():
            server.wait_serving()
        rounds = asyncio.run(_measure(servers, args))
    medians = {
        name: {figure: statistics.median(r[figure] for r in rounds if r["config"] == name) for figure in FIGURES}
        for name in ("a", "b")
    }
    for name in ("a", "b"):
        extra, env = getattr(args, f"{name}_args"), getattr(args, f"{name}_env")
        ids = " (token ids only)" if getattr(args, f"{name}_token_ids_only") else ""
        print(f"{name.upper()}: {extra or '(defaults)'} {' '.join(env)}{ids}")
    for figure in FIGURES:
        a, b = medians["a"][figure], medians["b"][figure]
        print(f"{figure:>38}: A {a:10.4f}  B {b:10.4f}  B ÷ A {b / a if a else float('nan'):.3f}")
    if args.output:
        raw = {"command": " ".join(sys.argv), "arguments": vars(args) | {"output": str(args.output)},
               "rounds": rounds, "medians": medians}  # fmt: skip
        write_results(args.output, raw, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
