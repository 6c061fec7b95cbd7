"""Where a streamed request's time to first token goes, in phasescope and in vLLM's gRPC worker, measured alike.

phasescope exports its own stages; vLLM's worker exports none of them, so the two cannot be compared
from their own figures. This runs either server with the same few stamps added (`run`), and loads both
side by side (`measure`), then splits each client's TTFT on the one monotonic clock (Linux's
`perf_counter` and `monotonic` are both CLOCK_MONOTONIC, shared by every process):

- `inbound`: the client's send → the handler is entered (gRPC both ways, the event loop's backlog);
- `intake`: handler entry → `AsyncLLM.add_request` is called (parsing, validation, admission);
- `add`: `add_request` itself (vLLM's input processing and the send to the engine core);
- `to_scheduled`: `add_request` returned → the engine core first scheduled it (the hop, the wait for a step);
- `prefill`: scheduled → the engine core's first token;
- `to_front`: the first token → its output is in the request's collector (the hop back, `process_outputs`);
- `to_yield`: in the collector → the handler yields its first message (the handler's wake-up);
- `write`: yielded → grpc.aio resumes the handler (the write);
- `outbound`: resumed → the client has the message.

Stamps are taken in the handler's own task (a context variable carries the request from its
`Generate` to `add_request`) and written one line per request to `$PHASESCOPE_TTFT_SPLIT`:

    .venv/bin/python -m loadtests.ttft_split measure --concurrency 64 --requests 384 --rounds 6 \\
        --output split.json.gz

`--variant NAME:ENV=VALUE,...` adds another phasescope server with those environment variables (another
checkout: `PYTHONSAFEPATH=1,PYTHONPATH=<worktree>`), in every round, each round starting with the next server;
the end prints each phasescope server's per-round TTFT and inbound ratios to vLLM's worker.

A diagnostic like `front_end_step_cost`: one more generator layer around each server's Generate and one
line written per request, the same on both sides.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import functools
import json
import os
import runpy
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

from phasescope.bench.launch import VLLM_GRPC_LAUNCHER

ENV = "PHASESCOPE_TTFT_SPLIT"
SEGMENTS = (
    ("inbound", "sent", "entry"),
    ("intake", "entry", "add"),
    ("add", "add", "added"),
    ("to_scheduled", "added", "scheduled"),
    ("prefill", "scheduled", "first_token"),
    ("to_front", "first_token", "put"),
    ("to_yield", "put", "yield"),
    ("write", "yield", "written"),
    ("outbound", "written", "received"),
)
_current: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("ttft_split", default=None)


def _wrap_generate(owner: Any, sink: Any) -> None:
    original = owner.Generate

    @functools.wraps(original)  # keeps what marks it (`maps_own_errors`)
    async def Generate(self: Any, request: Any, context: Any) -> AsyncGenerator[Any, None]:  # gRPC's name
        stamps: dict[str, Any] = {"id": getattr(request, "request_id", ""), "entry": time.monotonic()}
        token = _current.set(stamps)
        first = True
        try:
            async for response in original(self, request, context):
                if first:
                    stamps["yield"] = time.monotonic()
                yield response
                if first:
                    stamps["written"] = time.monotonic()
                    first = False
        finally:
            with contextlib.suppress(ValueError):  # closed from another context
                _current.reset(token)
            sink.write(json.dumps(stamps) + "\n")

    owner.Generate = Generate


def _wrap_add_request() -> None:
    from vllm.v1.engine.async_llm import AsyncLLM

    original = AsyncLLM.add_request

    async def add_request(self: Any, request_id: str, *args: Any, **kwargs: Any) -> Any:
        stamps = _current.get()
        started = time.monotonic()
        collector = await original(self, request_id, *args, **kwargs)
        if stamps is None or "add" in stamps:
            return collector
        stamps["add"], stamps["added"] = started, time.monotonic()
        put = collector.put

        def first_put(output: Any) -> None:
            if "put" not in stamps:
                stamps["put"] = time.monotonic()
                metrics = getattr(output, "metrics", None)
                if metrics is not None:
                    stamps.update(scheduled=metrics.scheduled_ts, first_token=metrics.first_token_ts)
            put(output)

        collector.put = first_put  # type: ignore[method-assign]  # this request's only
        return collector

    AsyncLLM.add_request = add_request  # type: ignore[method-assign]  # the diagnostic's stamp


def run(module: str, argv: list[str]) -> None:
    """Run a server module (`phasescope` with `serve ...`, or vLLM's launcher) with the stamps added."""
    sink = open(os.environ[ENV], "a", buffering=1)  # noqa: SIM115  # open for the process's life
    if module == "phasescope":
        from loadtests.front_end_what_if import apply_cuts
        from phasescope.serve.engine_protocol.servicer import VllmEngineServicer

        apply_cuts()  # $PHASESCOPE_WHAT_IF's, if any (`measure --what-if`)
        _wrap_generate(VllmEngineServicer, sink)
    from smg_grpc_servicer.vllm.servicer import VllmEngineServicer as VllmWorkerServicer  # type: ignore[import-untyped]

    _wrap_generate(VllmWorkerServicer, sink)
    _wrap_add_request()
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def _split(server: list[dict[str, Any]], client: dict[str, tuple[float, float]]) -> dict[str, list[float]]:
    """Each segment's milliseconds, over the requests every stamp of which is known."""
    out: dict[str, list[float]] = {name: [] for name, _, _ in SEGMENTS}
    out["client_ttft"] = []
    for stamps in server:
        times = client.get(stamps["id"])
        if times is None or not all(stamps.get(key) for key in ("add", "scheduled", "first_token", "put", "written")):
            continue
        stamps = {**stamps, "sent": times[0], "received": times[1]}
        for name, start, end in SEGMENTS:
            out[name].append(round((stamps[end] - stamps[start]) * 1e3, 3))
        out["client_ttft"].append(round((times[1] - times[0]) * 1e3, 3))
    return out


async def _measure(args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    from loadtests.serve_ab import serve_args, vllm_settings
    from phasescope.bench.harness import PhasescopeProcess
    from phasescope.bench.launch import phasescope_engine_target, start_vllm_grpc
    from phasescope.bench.loop import run_point
    from phasescope.bench.targets import VllmEngineTarget
    from phasescope.bench.tiny_model import ensure_tiny_model
    from phasescope.bench.workload import LengthDistribution, WorkloadSpec, derive_seed, workload
    from phasescope.serve.cpu_affinity import keep_off_worker_cpus

    model = str(ensure_tiny_model())
    max_num_seqs = max(args.concurrency, 16)
    variants = _variants(args)
    names = [*variants, "vllm"]
    sinks = {name: logs / f"{name}.stamps" for name in names}
    results: dict[str, Any] = {"rounds": []}
    with contextlib.ExitStack() as stack:
        servers = {}
        for name, env in variants.items():
            server = PhasescopeProcess(
                ["--model", model, *serve_args(max_num_seqs)], logs / f"{name}.log",
                env={ENV: str(sinks[name]), "PHASESCOPE_WHAT_IF": args.what_if, **env}, module="loadtests.ttft_split",
            )  # fmt: skip
            stack.callback(server.stop)
            servers[name] = server
        os.environ[ENV] = str(sinks["vllm"])
        worker, vllm_target = start_vllm_grpc(vllm_settings(model, max_num_seqs), logs, wrapper="loadtests.ttft_split")
        stack.callback(worker.stop)
        for server in servers.values():
            server.wait_serving()
        if args.pin_cpus and keep_off_worker_cpus() is None:
            print("ttft_split: --pin-cpus: no engine worker is bound to part of the CPUs", file=sys.stderr)
        targets: dict[str, VllmEngineTarget] = {
            name: phasescope_engine_target(server.address, None, server.process.pid, model)
            for name, server in servers.items()
        }
        targets["vllm"] = vllm_target
        spec = WorkloadSpec(
            LengthDistribution.parse(args.prompt_tokens), LengthDistribution.parse(str(args.max_tokens))
        )
        try:
            for target in targets.values():
                await run_point(target, workload(spec, 1, 16), concurrency=8, rate=None, seed=1, progress=lambda: None)
            for index in range(args.rounds):
                seed = derive_seed(args.seed, 0, index)
                # Each round starts with the next server, in turn.
                for name in names[index % len(names) :] + names[: index % len(names)]:
                    before = sinks[name].stat().st_size
                    records, _ = await run_point(targets[name], workload(spec, seed, args.requests),
                                                 concurrency=args.concurrency, rate=None, seed=seed,
                                                 progress=lambda: None)  # fmt: skip
                    await asyncio.sleep(0.5)  # the last lines reach the file
                    with sinks[name].open() as lines:
                        lines.seek(before)
                        stamps = [json.loads(line) for line in lines if line.strip()]
                    client = {
                        str(record.index): (record.sent, record.token_times[0])
                        for record in records
                        if record.token_times
                    }
                    # The bench's request id is bench-<index>-<uuid>.
                    for entry in stamps:
                        entry["id"] = entry["id"].split("-")[1] if entry["id"].startswith("bench-") else ""
                    split = _split(stamps, client)
                    medians = {key: statistics.median(values) for key, values in split.items() if values}
                    results["rounds"].append({"round": index + 1, "server": name, "requests": len(split["client_ttft"]),
                                              "median_ms": medians, "ms": split})  # fmt: skip
                    print(f"round {index + 1} {name:18s} " + "  ".join(f"{k} {v:.2f}" for k, v in medians.items()),
                          flush=True)  # fmt: skip
        finally:
            for target in targets.values():
                await target.close()
    return results


def _variants(args: argparse.Namespace) -> dict[str, dict[str, str]]:
    """phasescope's servers by name: `phasescope` with --phasescope-env, and each --variant's."""
    variants = {"phasescope": _pairs(args.phasescope_env)}
    for variant in args.variant:
        name, _, pairs = variant.partition(":")
        if not name or name in (*variants, "vllm"):
            raise SystemExit(f"ttft_split: --variant needs a new name before its ':', got {variant!r}")
        variants[name] = _pairs([pair for pair in pairs.split(",") if pair])
    return variants


def _pairs(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"ttft_split: an environment variable is NAME=VALUE, got {pair!r}")
        env[name] = value
    return env


def _ratios(rounds: list[dict[str, Any]], name: str, key: str) -> tuple[float, int, int]:
    """`name`'s round medians of `key` over vLLM's in the same round: the median ratio, how many were higher,
    out of how many rounds."""
    by_round: dict[int, dict[str, float]] = {}
    for entry in rounds:
        by_round.setdefault(entry["round"], {})[entry["server"]] = entry["median_ms"][key]
    ratios = [pair[name] / pair["vllm"] for pair in by_round.values() if name in pair and pair.get("vllm")]
    if not ratios:
        return float("nan"), 0, 0
    return statistics.median(ratios), sum(ratio > 1.0 for ratio in ratios), len(ratios)


def main() -> int:
    # As a server's wrapper: PhasescopeProcess runs `-m <module> serve ...`, start_vllm_grpc runs
    # `-m <module> <launcher> ...`.
    first = sys.argv[1] if len(sys.argv) > 1 else ""
    if first == "serve":
        run("phasescope", sys.argv[1:])
        return 0
    if first == VLLM_GRPC_LAUNCHER:
        run(VLLM_GRPC_LAUNCHER, sys.argv[2:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("command", choices=["measure"])
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=384)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", default="uniform:20:60")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pin-cpus", action="store_true", help="as bench --pin-cpus")
    parser.add_argument("--what-if", default="", metavar="CUTS", help="phasescope's front_end_what_if cuts")
    parser.add_argument("--phasescope-env", action="append", default=[], metavar="NAME=VALUE",
                        help="an environment variable for phasescope's server only (repeatable)")  # fmt: skip
    parser.add_argument("--variant", action="append", default=[], metavar="NAME:NAME=VALUE,...",
                        help="one more phasescope server, with these environment variables, in each round")  # fmt: skip
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    from phasescope.bench.harness import stop_on_sigterm, write_results

    stop_on_sigterm()
    logs = Path(tempfile.mkdtemp(prefix="ttft-split-"))
    results = asyncio.run(_measure(args, logs))
    names = [*_variants(args), "vllm"]
    keys = [name for name, _, _ in SEGMENTS] + ["client_ttft"]
    print(
        f"{'segment':>14}: "
        + "  ".join(f"{name:>10}" for name in names)
        + "   (median over rounds of each round's median, ms)"
    )
    summary: dict[str, dict[str, float]] = {}
    for key in keys:
        row = {
            name: statistics.median(
                r["median_ms"][key] for r in results["rounds"] if r["server"] == name and key in r["median_ms"]
            )
            for name in names
        }
        summary[key] = row
        print(f"{key:>14}: " + "  ".join(f"{row[name]:10.2f}" for name in names))
    for name in names[:-1]:
        for key in ("client_ttft", "inbound"):
            ratio, higher, rounds = _ratios(results["rounds"], name, key)
            summary.setdefault("ratios", {})[f"{name} {key}"] = ratio
            print(f"{name} ÷ vllm, {key}: median of rounds {ratio:.3f}, higher in {higher} of {rounds}")
    if args.output:
        arguments = {**vars(args), "output": str(args.output)}
        write_results(
            args.output, {"command": " ".join(sys.argv), "arguments": arguments, "summary": summary, **results}
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
