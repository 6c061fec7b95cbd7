"""Two phasescope configurations side by side: the same load, alternating rounds, throughput and front-end CPU.

A change to the front end (an event loop, a flag, a preloaded allocator) is judged here against
the configuration it replaces, both servers up at once on the same engine settings, the load
alternating between them round by round so machine drift hits both alike:

    .venv/bin/python -m loadtests.serve_ab --tiny-model --a-args "--event-loop asyncio" \\
        --b-args "--event-loop uvloop" --concurrency 64 --requests 256 --max-tokens 128 --rounds 3

Each round is one closed-loop run of `--requests` seeded requests (the same prompts on A and
B in a round). Printed per round and as medians: output tokens/s, TPOT p50, TTFT p50 and the
front-end process's CPU seconds per 1,000 streamed tokens (user + system of the serving
process only, not its engine core), then B ÷ A of the medians and B ÷ A round by round (with the
median of the rounds' ratios: drift between rounds cancels within one). `--a-env`/`--b-env` set
environment variables of one server (e.g. LD_PRELOAD); `--a-token-ids-only`/`--b-token-ids-only` make
one side's requests ask for token ids without text. Raw rounds go to --output; `serve_ab ratios
ROUNDS.json.gz[:a|:b] ...` prints kept runs' ratios round by round, that side ÷ the other (b by default),
the runs' rounds pooled, each median with its 95 % bootstrap interval over the rounds.
Each run starts after `--settle` seconds of quiet (the server that ran last goes idle first).

Against vLLM's own gRPC worker, and with parts of phasescope's work cut out
(`loadtests/front_end_what_if.py`): `--b-vllm-grpc` makes B vLLM's worker (started as `phasescope
bench --compare` starts it, its servicer's planned warm-up off), `--engine-protocol` sends both
sides token ids over vLLM's engine protocol as the smg gateway does (implied by `--b-vllm-grpc`),
`--a-vllm-grpc` makes A vLLM's worker instead (started first: each server's place in the run swapped),
`--a-what-if`/`--b-what-if` name one side's cuts, and `--pin-cpus` keeps every engine worker's
CPUs to it as `bench --pin-cpus` does (this driver, its client included, and both servers' other
processes on the rest):

    .venv/bin/python -m loadtests.serve_ab --tiny-model --b-vllm-grpc --pin-cpus \\
        --a-what-if no-step-telemetry,bare-took --concurrency 16 --requests 384 --rounds 4
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import json
import shlex
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from phasescope.bench.harness import ManagedProcess, PhasescopeProcess, stop_on_sigterm, write_results
from phasescope.bench.launch import EngineSettings, phasescope_engine_target, start_vllm_grpc
from phasescope.bench.loop import run_point
from phasescope.bench.summary import summarize
from phasescope.bench.targets import PhasescopeTarget, Target
from phasescope.bench.workload import LengthDistribution, WorkloadSpec, derive_seed, workload
from phasescope.serve.cpu_affinity import keep_off_worker_cpus

FIGURES = (
    "output_throughput",
    "median_tpot_ms",
    "median_ttft_ms",
    "frontend_cpu_seconds_per_1k_tokens",
    "engine_core_cpu_seconds_per_1k_tokens",
)


def _cpu(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def _engine_core_cpu(pid: int) -> float:
    """CPU seconds of the server's engine-core processes (vLLM titles them `VLLM::EngineCore...`): the scheduler
    shares the front end's CPUs under --pin-cpus, the model's worker does not."""
    total = 0.0
    for child in psutil.Process(pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "EngineCore" in " ".join(child.cmdline()):
                times = child.cpu_times()
                total += times.user + times.system
    return total


def serve_args(max_num_seqs: int) -> list[str]:
    """`phasescope serve`'s engine flags for a side-by-side run (the tiny model's regime: eager, float32, 2 GiB of
    KV cache); `vllm_settings` starts vLLM's worker on the same engine."""
    return ["--enforce-eager", "--dtype", "float32", "--max-model-len", "2048", "--kv-cache-gib", "2",
            "--max-concurrent-requests", str(max_num_seqs), "--max-queued-requests", "4096"]  # fmt: skip


def vllm_settings(model: str, max_num_seqs: int) -> EngineSettings:
    """vLLM's gRPC worker on the engine of `serve_args`."""
    return EngineSettings(model, Path(model).name, "float32", 2048, 2.0, max_num_seqs)


def _env(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"serve_ab: --a-env/--b-env take NAME=VALUE, got {pair!r}")
        env[name] = value
    return env


async def _round(target: Target, pid: int, spec: WorkloadSpec, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    requests = workload(spec, seed, args.requests)
    before, core_before = _cpu(pid), _engine_core_cpu(pid)
    if args.bursts:
        records, duration = await run_point(target, requests, concurrency=None, rate=None, seed=seed,
                                            progress=lambda: None, burst=args.bursts)  # fmt: skip
    else:
        records, duration = await run_point(target, requests, concurrency=args.concurrency, rate=None, seed=seed,
                                            progress=lambda: None)  # fmt: skip
    cpu, core = _cpu(pid) - before, _engine_core_cpu(pid) - core_before
    summary = summarize(records, duration)
    if not summary["total_output_tokens"]:
        errors = sorted({record.error for record in records if record.error})
        raise SystemExit(f"serve_ab: {target.name} streamed no token in a round: {'; '.join(errors) or 'no error'}")
    summary["frontend_cpu_seconds_per_1k_tokens"] = cpu / (summary["total_output_tokens"] / 1e3)
    summary["engine_core_cpu_seconds_per_1k_tokens"] = core / (summary["total_output_tokens"] / 1e3)
    return {key: summary[key] for key in (*FIGURES, "total_output_tokens", "errors", "duration")}


async def _measure(
    servers: dict[str, ManagedProcess], targets: dict[str, Target], args: argparse.Namespace
) -> list[dict[str, Any]]:
    spec = WorkloadSpec(LengthDistribution.parse(args.prompt_tokens), LengthDistribution.parse(str(args.max_tokens)))
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
                # The server that just ran keeps spinning for a moment (vLLM's shared-memory queue readers poll
                # for a second after their last message) on the CPUs the next one needs: let it go idle first.
                await asyncio.sleep(args.settle)
                result = await _round(targets[name], servers[name].process.pid, spec, seed, args)
                rounds.append({"round": index + 1, "config": name, **result})
                print(
                    f"round {index + 1} {name}: {result['output_throughput']:8.1f} tok/s  "
                    f"TPOT p50 {result['median_tpot_ms']:6.1f} ms  TTFT p50 {result['median_ttft_ms']:7.1f} ms  "
                    f"front-end CPU {result['frontend_cpu_seconds_per_1k_tokens']:.4f} s/1k tok  "
                    f"engine core {result['engine_core_cpu_seconds_per_1k_tokens']:.4f}  "
                    f"errors {result['errors']}",
                    flush=True,
                )
    finally:
        for target in targets.values():
            await target.close()
    return rounds


async def _serve_and_measure(
    args: argparse.Namespace, engine: list[str], model: str, max_num_seqs: int, logs: Path
) -> list[dict[str, Any]]:
    """Start both servers, then measure; on the measuring loop, as a gRPC aio channel (a target's) belongs to the
    loop it was opened on. Starting blocks that loop, with nothing else on it yet."""
    with contextlib.ExitStack() as stack:
        servers: dict[str, ManagedProcess] = {}
        targets: dict[str, Target] = {}
        sides = (("a", args.a_args, args.a_env, args.a_what_if, args.a_token_ids_only),
                 ("b", args.b_args, args.b_env, args.b_what_if, args.b_token_ids_only))  # fmt: skip
        for name, extra, env, cuts, ids_only in sides:
            if getattr(args, f"{name}_vllm_grpc"):
                worker, targets[name] = start_vllm_grpc(vllm_settings(model, max_num_seqs), logs)
                stack.callback(worker.stop)
                servers[name] = worker
                continue
            what_if = {"PHASESCOPE_WHAT_IF": cuts} if cuts else {}
            server = PhasescopeProcess([*engine, *shlex.split(extra)], logs / f"{name}.log", env=_env(env) | what_if,
                                       module="loadtests.front_end_what_if" if cuts else "phasescope")  # fmt: skip
            stack.callback(server.stop)
            servers[name] = server
            pid = server.process.pid
            if args.engine_protocol:
                targets[name] = phasescope_engine_target(server.address, None, pid, model)
            else:
                targets[name] = PhasescopeTarget(server.address, None, pid, token_ids_only=ids_only)
        for process in servers.values():
            if isinstance(process, PhasescopeProcess):
                process.wait_serving()
        if args.pin_cpus and keep_off_worker_cpus() is None:
            print("serve_ab: --pin-cpus: no engine worker is bound to part of the CPUs; nothing moved", file=sys.stderr)
        return await _measure(servers, targets, args)


def round_ratios(rounds: list[dict[str, Any]], numerator: str = "b") -> dict[str, list[float]]:
    """Each figure's ratio in every round both sides ran, `numerator` ÷ the other side, in round order."""
    by_round: dict[Any, dict[str, dict[str, Any]]] = {}
    for result in rounds:
        by_round.setdefault(result["round"], {})[result["config"]] = result
    other = "a" if numerator == "b" else "b"
    pairs = [sides for _, sides in sorted(by_round.items()) if numerator in sides and other in sides]
    return {
        figure: [sides[numerator][figure] / sides[other][figure] for sides in pairs if sides[other][figure]]
        for figure in FIGURES
    }


def median_interval(ratios: list[float], resamples: int = 4000, seed: int = 0) -> tuple[float, float]:
    """A 95 % bootstrap interval of the median of `ratios` (rounds resampled with replacement, seeded):
    how far the rounds a run kept pin its median down on this machine."""
    draws = np.random.default_rng(seed).choice(np.asarray(ratios), size=(resamples, len(ratios)))
    low, high = np.percentile(np.median(draws, axis=1), [2.5, 97.5])
    return float(low), float(high)


def print_round_ratios(rounds: list[dict[str, Any]], numerator: str = "b", names: tuple[str, str] = ("", "")) -> None:
    """The ratios round by round, their median, in how many rounds the numerator's figure was the higher, and
    the median's 95 % bootstrap interval: drift on the machine lands on both sides of a round alike, so a
    round's ratio is steadier than a median's. `names` names the numerator's side and the other (A and B by
    default)."""
    name = names[0] or numerator.upper()
    other = names[1] or ("A" if name == "B" else "B")
    print(
        f"per round, {name} ÷ {other}: the median of the rounds' ratios (rounds where {name} is higher) "
        "[its 95 % bootstrap interval], each"
    )
    for figure, ratios in round_ratios(rounds, numerator).items():
        if ratios:
            higher = sum(ratio > 1 for ratio in ratios)
            low, high = median_interval(ratios)
            each = " ".join(f"{ratio:.2f}" for ratio in ratios)
            print(
                f"{figure:>38}: {statistics.median(ratios):.3f} ({higher} of {len(ratios)}) "
                f"[{low:.3f}–{high:.3f}]  {each}"
            )


def reread(kept: list[str]) -> int:
    """`serve_ab ratios ROUNDS.json.gz[:a|:b] ...`: kept runs' ratios round by round, the named side ÷ the other
    (b by default), several runs' rounds pooled (the same server in each place, say)."""
    pooled: list[dict[str, Any]] = []
    for number, entry in enumerate(kept):
        path, _, side = entry.rpartition(":") if entry.endswith((":a", ":b")) else (entry, "", "b")
        raw = Path(path).read_bytes()
        for result in json.loads(gzip.decompress(raw) if path.endswith(".gz") else raw)["rounds"]:
            # Renamed so the named side is B, each run's rounds numbered apart.
            config = "b" if result["config"] == side else "a"
            pooled.append(result | {"round": (number, result["round"]), "config": config})
    print_round_ratios(pooled, names=("the side named", "the other"))
    return 0


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["ratios"]:
        return reread(argv[1:])
    stop_on_sigterm()  # the servers and engines it starts are stopped on SIGTERM too
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--a-args", default="", help="serve flags of configuration A (shell-quoted)")
    parser.add_argument("--b-args", default="", help="serve flags of configuration B")
    parser.add_argument("--a-env", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--b-env", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--a-token-ids-only", action="store_true", help="A's requests ask for token ids only")
    parser.add_argument("--b-token-ids-only", action="store_true", help="B's requests ask for token ids only")
    parser.add_argument("--a-what-if", default="", metavar="CUTS", help="A's front_end_what_if cuts")
    parser.add_argument("--b-what-if", default="", metavar="CUTS", help="B's front_end_what_if cuts")
    parser.add_argument("--a-vllm-grpc", action="store_true", help="A is vLLM's gRPC worker (started first)")
    parser.add_argument("--b-vllm-grpc", action="store_true", help="B is vLLM's gRPC worker")
    parser.add_argument("--engine-protocol", action="store_true", help="token ids over vLLM's engine protocol")
    parser.add_argument("--pin-cpus", action="store_true", help="as bench --pin-cpus")
    parser.add_argument("--tiny-model", action="store_true", help="serve the tiny model (else the default)")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--bursts", type=int, default=0, help="waves of N at once instead of a closed loop")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", default="uniform:20:60")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--settle", type=float, default=2.0, help="seconds of quiet before each run (the last server goes idle)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, help="raw rounds as JSON, gzipped if it ends in .gz")
    args = parser.parse_args(argv)

    args.engine_protocol = args.engine_protocol or args.a_vllm_grpc or args.b_vllm_grpc
    max_num_seqs = max(args.concurrency, args.bursts, 16)
    engine = serve_args(max_num_seqs)
    model = ""  # phasescope's embedded default unless a tokenizer is needed here (token ids are sent)
    if args.tiny_model:
        from phasescope.bench.tiny_model import ensure_tiny_model

        model = str(ensure_tiny_model())
    elif args.engine_protocol:
        from phasescope.engine.default_model import ensure_default_model

        model = str(ensure_default_model())
    if model:
        engine += ["--model", model]
    logs = Path(tempfile.mkdtemp(prefix="serve-ab-"))
    rounds = asyncio.run(_serve_and_measure(args, engine, model, max_num_seqs, logs))
    medians = {
        name: {figure: statistics.median(r[figure] for r in rounds if r["config"] == name) for figure in FIGURES}
        for name in ("a", "b")
    }
    for name in ("a", "b"):
        extra, env = getattr(args, f"{name}_args"), getattr(args, f"{name}_env")
        ids = " (token ids only)" if getattr(args, f"{name}_token_ids_only") else ""
        cuts = getattr(args, f"{name}_what_if")
        what = "vLLM's gRPC worker" if getattr(args, f"{name}_vllm_grpc") else extra or "(defaults)"
        print(f"{name.upper()}: {what} {' '.join(env)}{ids}{f' cut: {cuts}' if cuts else ''}")
    for figure in FIGURES:
        a, b = medians["a"][figure], medians["b"][figure]
        print(f"{figure:>38}: A {a:10.4f}  B {b:10.4f}  B ÷ A {b / a if a else float('nan'):.3f}")
    print_round_ratios(rounds)
    if args.output:
        raw = {"command": " ".join(sys.argv), "arguments": vars(args) | {"output": str(args.output)},
               "rounds": rounds, "medians": medians}  # fmt: skip
        write_results(args.output, raw, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
