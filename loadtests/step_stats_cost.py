"""What the engine's per-step accounting costs, on a tiny random-weight model fast enough for it to show.

phasescope starts vLLM with `enable_logging_iteration_details` (per-step token counts and
execution time) and `enable_mfu_metrics` (vLLM's analytic FLOPs and bytes per step): both
enlarge every output message from the engine core. On the embedded 135M model the engine's
own step time hides that; this builds a tiny Llama with random weights (the default model's
tokenizer; 2 layers, hidden 128, 2 heads, 1 KV head, head dim 64 — built here with
transformers, never downloaded) and runs the same load through an in-process AsyncLLM with
the accounting on and off, alternating rounds so machine drift hits both alike.

    .venv/bin/python -m loadtests.step_stats_cost --rounds 3 --concurrency 32 --max-tokens 128

prints each round's output tokens/s and the median ratio (on ÷ off); raw rounds go to --output.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from phasescope.bench.harness import stop_on_sigterm, write_results
from phasescope.bench.tiny_model import build_tiny_model


async def one_round(model: str, accounting: bool, concurrency: int, max_tokens: int) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(
        model=model,
        dtype="float32",
        enforce_eager=True,
        max_model_len=1024,
        max_num_seqs=max(concurrency, 16),
        kv_cache_memory_bytes=int(0.5 * 2**30),
        disable_log_stats=False,
        enable_logging_iteration_details=accounting,
        enable_mfu_metrics=accounting,
    )
    llm = AsyncLLM.from_engine_args(args)
    try:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)

        async def stream(index: int) -> int:
            count = 0
            async for output in llm.generate({"prompt_token_ids": [1, 100 + index, 200]}, params, uuid.uuid4().hex):
                count = len(output.outputs[0].token_ids)
            return count

        await stream(0)  # warm-up
        started, cpu_started = time.perf_counter(), time.process_time()
        tokens = sum(await asyncio.gather(*(stream(i) for i in range(concurrency))))
        seconds = time.perf_counter() - started
        cpu = time.process_time() - cpu_started
    finally:
        llm.shutdown()
        gc.collect()
    # This process is the front end (AsyncLLM's output processing) and the load's client; its engine core
    # is another process: CPU here is what the front end pays for each token's outputs.
    return {"accounting": accounting, "tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds,
            "cpu_seconds_per_1k_tokens": cpu / (tokens / 1e3)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    stop_on_sigterm()  # the servers and engines it starts are stopped on SIGTERM too
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds per setting (alternating)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--output", type=Path, help="raw rounds as JSON, gzipped if it ends in .gz")
    args = parser.parse_args(argv)
    folder = build_tiny_model(Path(tempfile.mkdtemp(prefix="tiny-llama-")))
    rounds = []
    try:
        for index in range(2 * args.rounds):
            accounting = index % 2 == 0
            result = asyncio.run(one_round(str(folder), accounting, args.concurrency, args.max_tokens))
            rounds.append(result)
            print(
                f"round {index + 1}: accounting {'on ' if accounting else 'off'}  "
                f"{result['tokens_per_second']:9.1f} tok/s ({result['tokens']} tokens in {result['seconds']:.2f} s), "
                f"front-end CPU {result['cpu_seconds_per_1k_tokens']:.4f} s/1k tokens",
                flush=True,
            )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    on = statistics.median(float(r["tokens_per_second"]) for r in rounds if r["accounting"])
    off = statistics.median(float(r["tokens_per_second"]) for r in rounds if not r["accounting"])
    print(f"median tokens/s: accounting on {on:.1f}, off {off:.1f}: on ÷ off = {on / off:.3f}")
    cpu_on = statistics.median(float(r["cpu_seconds_per_1k_tokens"]) for r in rounds if r["accounting"])
    cpu_off = statistics.median(float(r["cpu_seconds_per_1k_tokens"]) for r in rounds if not r["accounting"])
    print(f"median front-end CPU s/1k tokens: on {cpu_on:.4f}, off {cpu_off:.4f}: on ÷ off = {cpu_on / cpu_off:.3f}")
    if args.output:
        summary = {"on": on, "off": off, "ratio": on / off, "cpu_on": cpu_on, "cpu_off": cpu_off}
        write_results(args.output, {"arguments": vars(args) | {"output": str(args.output)},
                                    "rounds": rounds, "summary": summary}, indent=2)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
