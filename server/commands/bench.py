"""`phasescope bench`: the flags of the benchmark harness; the harness itself lives in `loadtests.bench`.

This is the one place under `server/` that reaches into `loadtests/`, and only
inside `cmd`: the server never needs the benchmarks to run.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from server.commands import Subparsers


def add_cli_args(subparsers: Subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "bench",
        help="load sweeps with vLLM bench-serve results, plots, and --compare against vLLM",
        description="Seeded concurrency and Poisson-rate sweeps against phasescope (started here unless --address); "
        "--compare adds AsyncLLM in-process and vLLM's OpenAI server on the same workload.",
    )
    parser.add_argument("--concurrency", default="1,4,16", help="closed-loop points, comma-separated (default 1,4,16)")
    parser.add_argument("--rates", default="", help="Poisson arrival rates in requests/s, comma-separated")
    parser.add_argument("--requests", type=int, default=32, help="measured requests per point")
    parser.add_argument("--warmup", type=int, default=4, help="requests before each point, excluded")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (ignore_eos)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--address", help="a running phasescope (host:port) instead of starting one")
    parser.add_argument("--metrics-url", help="with --address: its /metrics URL, for the server-side view")
    parser.add_argument("--compare", action="store_true", help="also run in-process AsyncLLM and vLLM's OpenAI server")
    parser.add_argument("--model", default="", help="model folder (default: the embedded default)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-gib", type=float, default=2.0)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--output-dir", type=Path, default=Path("loadtests/results/bench"))
    return parser


def cmd(args: argparse.Namespace) -> int:
    from loadtests.bench import main

    return main(args)
