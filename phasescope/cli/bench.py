"""`phasescope bench`: the flags of the benchmark harness; the harness itself lives in `phasescope.bench`,
imported only inside `cmd` so that `phasescope --help` stays fast."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from phasescope.cli import Subparsers


def add_cli_args(subparsers: Subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "bench",
        help="load sweeps and SLA searches with goodput, repeats, the hardware at each point, and a report",
        description="Seeded concurrency and Poisson-rate sweeps against phasescope (started here unless --address): "
        "goodput under --slo, --sla-search for the highest load that meets it, --repeats with their spread, a rate "
        "sweep that stops once the server is over-saturated, the server's bandwidth saturation, compute use and "
        "verdicts per point, and a Markdown report with plots. --compare adds AsyncLLM in-process, vLLM's "
        "OpenAI server, vLLM's gRPC worker and phasescope over vLLM's engine protocol on the same workload, "
        "interleaved point by point; --vllm-grpc-address and --gateway-url measure running endpoints too. With "
        "--rounds N every point runs N rounds and each target is set beside a baseline round by round, with "
        "intervals; --variant starts more phasescope servers (another checkout, other flags) beside it.",
    )
    load = parser.add_argument_group("load")
    load.add_argument("--concurrency", default="1,4,16", help="closed-loop points, comma-separated (default 1,4,16)")
    load.add_argument("--rates", default="", help="Poisson arrival rates in requests/s, comma-separated")
    load.add_argument(
        "--bursts",
        default="",
        help="burst points: waves of N requests sent at once, the next wave when the previous one has ended "
        "(TTFT under a burst), comma-separated",
    )
    load.add_argument("--requests", type=int, default=32, help="measured requests per run")
    load.add_argument("--warmup", type=int, default=4, help="requests before each point, excluded")
    load.add_argument(
        "--rounds",
        "--repeats",
        dest="repeats",
        type=int,
        default=1,
        help="runs per point (rounds), each with its own seed: in a round every target runs once on the same "
        "prompts, the order reversed every other round; figures are the median, with min–max, and with two "
        "targets or more each one's ratio to --baseline is the median of the rounds' ratios with its 95 %% "
        "bootstrap interval",
    )
    load.add_argument(
        "--settle",
        type=float,
        default=2.0,
        help="seconds of quiet before each run of a point with several targets, so the target that ran last "
        "is idle (vLLM's shared-memory queues spin for a second after their last message; default 2)",
    )
    load.add_argument(
        "--no-saturation-stop",
        dest="saturation_stop",
        action="store_false",
        help="run every --rates point even after the server is over-saturated",
    )

    workload = parser.add_argument_group("workload (seeded: the results hold every parameter)")
    workload.add_argument(
        "--prompt-tokens",
        default="uniform:20:60",
        help="prompt length after the shared prefix: N, uniform:LOW:HIGH or normal:MEAN:STD (default uniform:20:60)",
    )
    workload.add_argument(
        "--max-tokens",
        default="64",
        help="output tokens per request (ignore_eos): N, uniform:LOW:HIGH or normal:MEAN:STD",
    )
    workload.add_argument(
        "--shared-prefix-tokens",
        type=int,
        default=0,
        help="the same N tokens at the start of every prompt (prefix-cache behaviour)",
    )
    workload.add_argument(
        "--prompts-file",
        help='JSONL of {"prompt": "...", "max_tokens": N} per line, drawn '
        "in a seeded order (max_tokens optional: --max-tokens otherwise)",
    )
    workload.add_argument(
        "--api",
        choices=("prompt", "chat"),
        default="prompt",
        help="send a completion prompt, or the prompt as one chat user message",
    )
    workload.add_argument(
        "--token-ids-only",
        action="store_true",
        help="phasescope's requests ask for token ids without text (GenerateRequest.token_ids_only); "
        "the other targets still detokenise",
    )
    workload.add_argument(
        "--adapters",
        type=int,
        default=0,
        help="spread the requests over N LoRA adapters (adapter-0 … adapter-N-1), made on the spot for the model "
        "and served by the phasescope started here (--lora-modules, --max-loras N unless --serve-args sets it); "
        "0: the base model (default)",
    )
    workload.add_argument(
        "--adapter-mix",
        default="uniform",
        help="with --adapters: how requests pick their adapter, uniform or zipf[:S] (adapter k weighted 1/(k+1)^S, "
        "S default 1)",
    )
    workload.add_argument(
        "--adapter-rank",
        type=int,
        default=8,
        help="with --adapters: each adapter's rank (q_proj and v_proj; default 8)",
    )
    workload.add_argument("--seed", type=int, default=0)

    slo = parser.add_argument_group("objectives and the SLA search")
    slo.add_argument(
        "--slo",
        default="",
        help="objectives in ms, any subset: ttft_ms=2000,tpot_ms=150,e2e_ms=10000 (goodput per point)",
    )
    slo.add_argument(
        "--sla-search",
        choices=("rate", "concurrency"),
        help="find the highest Poisson rate (or concurrency) whose goodput ratio meets "
        "--goodput-target (replaces --concurrency/--rates)",
    )
    slo.add_argument(
        "--goodput-target",
        type=float,
        default=0.99,
        help="share of requests that must meet every --slo objective (default 0.99)",
    )
    slo.add_argument("--max-points", type=int, default=8, help="the search's budget of points (default 8)")
    slo.add_argument("--search-start", type=float, default=1.0, help="the search's first load (default 1)")
    slo.add_argument(
        "--search-factor",
        type=float,
        default=2.0,
        help="the search multiplies (or divides) the load by this until it brackets (default 2)",
    )
    slo.add_argument(
        "--search-tolerance",
        type=float,
        default=0.1,
        help="bisect until the bracket is this share of its lower end (rates; default 0.1)",
    )

    target = parser.add_argument_group("targets and engine")
    target.add_argument("--address", help="a running phasescope (host:port) instead of starting one")
    target.add_argument("--metrics-url", help="with --address: its /metrics URL, for the server-side view")
    target.add_argument(
        "--compare",
        action="store_true",
        help="also run in-process AsyncLLM, vLLM's OpenAI server and vLLM's gRPC worker (vllm-grpc), and "
        "phasescope over vLLM's engine protocol (phasescope-vllm-grpc, the same server as phasescope): all "
        "started at once, on the same engine settings (--compare-protocol narrows it)",
    )
    target.add_argument(
        "--compare-protocol",
        choices=("all", "phasescope", "engine", "rust"),
        help="with --compare, what is compared: phasescope (in-process, vllm-openai and phasescope over "
        "phasescope.v1: --compare before the engine protocol), engine (vllm-grpc and phasescope-vllm-grpc, "
        "vllm.grpc.engine.VllmEngine on both servers), rust (vllm-rust, vLLM's worker with smg's Rust request "
        "path, and phasescope-vllm-grpc: add --variant rust='--front-end rust' for phasescope's Rust mode), or "
        "all (the five; default). all runs each point on five targets where either of the others runs it on "
        "three or two, so it takes that much longer",
    )
    target.add_argument(
        "--vllm-grpc-address",
        help="a running vllm.grpc.engine.VllmEngine endpoint (host:port; vLLM's gRPC worker or phasescope), "
        "measured too as vllm-grpc-endpoint; nothing is started for it. Its tokenizer (the bench sends token "
        "ids, as the smg gateway does): --model when given, else what its GetModelInfo names. Without "
        "--compare or --address no phasescope is started: the named endpoints alone are measured",
    )
    target.add_argument(
        "--gateway-url",
        help="a running OpenAI-compatible gateway (http://host:port, the smg gateway say) measured too as "
        "gateway, over /v1/completions or /v1/chat/completions with the first model of its /v1/models; nothing "
        "is started for it, and it has no front-end CPU figure. Without --compare or --address no phasescope "
        "is started",
    )
    target.add_argument(
        "--serve-args",
        default="",
        metavar="WORDS",
        help="for the phasescope started here, shell-quoted: NAME=VALUE words first (its environment: "
        "'PYTHONSAFEPATH=1 PYTHONPATH=/path/to/checkout' runs that checkout's code), then `phasescope serve` "
        "flags",
    )
    target.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=WORDS",
        help="another phasescope started beside it, WORDS as in --serve-args, measured as NAME (and "
        "NAME-vllm-grpc over vLLM's engine protocol); repeatable",
    )
    target.add_argument(
        "--baseline",
        metavar="TARGET",
        help="the target every other is divided by, round by round (default: vllm-grpc when measured, else "
        "the first target)",
    )
    target.add_argument("--model", default="", help="model folder (default: the embedded default)")
    target.add_argument(
        "--tiny-model",
        action="store_true",
        help="a 2-layer random-weight Llama with the default tokenizer, built once and cached: the engine "
        "streams thousands of tokens/s, so the front end's cost shows as it would on an accelerator",
    )
    target.add_argument("--dtype", default="float32")
    target.add_argument("--max-model-len", type=int, default=2048)
    target.add_argument("--kv-cache-gib", type=float, default=2.0)
    target.add_argument("--max-num-seqs", type=int, default=64)
    target.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="tokens per streamed chunk on every target started here (vLLM's stream_interval; default 1)",
    )

    target.add_argument(
        "--scrape-interval",
        type=float,
        default=2.0,
        help="seconds between reads of each target's /metrics during a run, phasescope's and vLLM's OpenAI "
        "server's alike, so each pays for its own exposition (0: one read as a run ends; default 2)",
    )

    target.add_argument(
        "--peer-first",
        action="store_true",
        help="with --compare: start the engine-protocol peer (vllm-grpc or vllm-rust) before phasescope's servers "
        "instead of after; a server's place is worth a few percent on a small machine, so pool a run of each "
        "order (--pool)",
    )

    target.add_argument(
        "--pin-cpus",
        action="store_true",
        help="on CPU engines, once every target is up: keep this client and every target's front end and engine "
        "core off the CPUs vLLM bound the engines' workers to (as serve --pin-front-end does), so the model's "
        "compute is never preempted and the front ends compete for the rest",
    )

    output = parser.add_argument_group("output")
    output.add_argument(
        "--output-dir",
        type=Path,
        default=Path("loadtests/results/bench"),
        help="bench.json.gz (the raw results, gzip-compressed JSON), report.md and the plots "
        "(default loadtests/results/bench)",
    )
    output.add_argument(
        "--pool",
        nargs="+",
        type=Path,
        metavar="BENCH_JSON_GZ",
        help="run nothing: read kept results (bench.json.gz) and print each target's ratio to --baseline pooled "
        "over all their rounds, each result's rounds paired within it (the same command with the servers "
        "started in the other order, say)",
    )
    output.add_argument(
        "--no-token-times",
        dest="token_times",
        action="store_false",
        help="keep TTFT, TPOT and E2E per request but not every token's arrival (smaller results)",
    )
    return parser


def cmd(args: argparse.Namespace) -> int:
    from phasescope.bench import main

    return main(args)
