"""What distinct LoRA adapters per batch cost, measured on one server beside the calculator's prediction.

One `phasescope serve` of a model (the tiny random-weight model by default) with `--adapters` LoRA adapters made on
the spot (rank `--rank`, q_proj and v_proj) and `--max-loras` as many, so every adapter runs in the same step. Each
round sends `--batch` requests at once (token ids, `--max-tokens` each, ignore_eos) for every way of spreading them:
over 0 adapters (the base model), 1, 2, 4, … up to `--adapters` (round-robin), the ways in a new order each round.
For each way it reports the decode tokens/s of the batch (output tokens ÷ the batch's wall time, median over the
rounds) and its ratio to the base model's in the same round, beside what the calculator (`phasescope roofline
--lora-rank`, `phasescope.telemetry.model.lora`) predicts at the server's own peaks:

    .venv/bin/python -m loadtests.lora_adapters --rounds 6 --batch 8 --out docs/data/lora-adapters-YYYY-MM-DD

The server is stopped when the measurement ends. Findings: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from phasescope.bench.adapters import write_lora_adapter
from phasescope.bench.harness import PhasescopeProcess
from phasescope.bench.tiny_model import ensure_tiny_model
from phasescope.client.client import AsyncClient, build_request
from phasescope.telemetry.exposition import fetch_samples
from phasescope.telemetry.hardware.peaks import HardwarePeaks
from phasescope.telemetry.model.cost import model_cost_from_folder
from phasescope.telemetry.model.lora import lora_rows, lora_shape


def ways(adapters: int) -> list[int]:
    """0 (the base model), then 1, 2, 4, … adapters, up to `adapters`."""
    out, n = [0], 1
    while n < adapters:
        out.append(n)
        n *= 2
    return [*out, adapters]


async def one_batch(address: str, batch: int, spread: int, max_tokens: int, prompt: list[int]) -> tuple[float, int]:
    """The batch's wall time and output tokens, its requests round-robin over `spread` adapters."""
    async with AsyncClient(address, timeout_seconds=600) as client:

        async def ask(index: int) -> int:
            adapter = f"adapter-{index % spread}" if spread else ""
            request = build_request(
                token_ids=prompt, max_tokens=max_tokens, ignore_eos=True, token_ids_only=True, adapter=adapter
            )
            return int((await client.generate(request)).usage.completion_tokens)

        started = time.perf_counter()
        tokens = await asyncio.gather(*(ask(index) for index in range(batch)))
        return time.perf_counter() - started, sum(tokens)


def predicted(model: Path, peaks: HardwarePeaks, dtype: str, batch: int, context: int, rank: int, n: int) -> float:
    """The calculator's decode tokens/s with the batch over `n` adapters ÷ without."""
    cost = model_cost_from_folder(model, dtype)
    config = json.loads((model / "config.json").read_text())
    shape = lora_shape(config, rank, ["q_proj", "v_proj"], dtype)
    row = lora_rows(cost, peaks, dtype, (batch,), context, shape, max(1, n)).rows[0]
    return row.throughput_ratio if n else 1.0


def served_peaks(metrics_url: str) -> HardwarePeaks:
    from phasescope.cli.roofline import served_peaks as read

    peaks = read(fetch_samples(metrics_url))
    if peaks is None:
        raise SystemExit("the server exports no peaks")
    return peaks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="model folder (default: the tiny random-weight model)")
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out", type=Path, help="folder for raw.json.gz (the rounds' figures and the settings)")
    args = parser.parse_args(argv)
    model = args.model or ensure_tiny_model()
    config = json.loads((model / "config.json").read_text())
    with tempfile.TemporaryDirectory(prefix="lora-adapters-") as scratch:
        folder = Path(scratch)
        pairs = [
            f"adapter-{k}={write_lora_adapter(folder / f'a{k}', config, rank=args.rank, seed=k)}"
            for k in range(args.adapters)
        ]
        serve = [
            "--model", str(model), "--enforce-eager", "--max-model-len", "2048", "--kv-cache-gib", "1",
            "--max-concurrent-requests", str(max(args.batch, 8)), "--lora-modules", *pairs,
            "--max-loras", str(args.adapters), "--max-lora-rank", str(args.rank),
        ]  # fmt: skip
        with PhasescopeProcess(serve, folder / "serve.log") as server:
            server.wait_serving()
            peaks = served_peaks(server.metrics_url)
            prompt = [100 + 7 * i for i in range(args.prompt_tokens)]
            spreads = ways(args.adapters)
            rounds: list[dict[str, Any]] = []
            order = random.Random(0)
            # One unmeasured batch per way first: every adapter's weights are loaded before any round counts.
            for spread in spreads:
                asyncio.run(one_batch(server.address, args.batch, spread, 4, prompt))
            for number in range(args.rounds):
                shuffled = spreads[:]
                order.shuffle(shuffled)
                figures = {}
                for spread in shuffled:
                    seconds, tokens = asyncio.run(
                        one_batch(server.address, args.batch, spread, args.max_tokens, prompt)
                    )
                    figures[str(spread)] = {"seconds": seconds, "tokens": tokens, "tokens_per_second": tokens / seconds}
                rounds.append({"round": number, "order": shuffled, "ways": figures})
                shown = ", ".join(f"{s}: {figures[str(s)]['tokens_per_second']:,.0f} tok/s" for s in spreads)
                print(f"round {number + 1}/{args.rounds}: {shown}", file=sys.stderr)
    dtype = "float32"
    context = args.prompt_tokens + args.max_tokens // 2
    print(f"{'adapters':>8} {'tok/s (median)':>15} {'÷ base (median)':>16} {'calculator':>11}")
    summary = []
    for spread in spreads:
        rates = [r["ways"][str(spread)]["tokens_per_second"] for r in rounds]
        ratios = [r["ways"][str(spread)]["tokens_per_second"] / r["ways"]["0"]["tokens_per_second"] for r in rounds]
        expect = predicted(model, peaks, dtype, args.batch, context, args.rank, spread)
        summary.append({"adapters": spread, "tokens_per_second_median": statistics.median(rates),
                        "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
                        "ratio_max": max(ratios), "calculator_ratio": expect})  # fmt: skip
        print(f"{spread:>8} {statistics.median(rates):>15,.0f} {statistics.median(ratios):>16.3f} {expect:>11.4f}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        data = {"settings": {**{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                             "model": str(model), "peaks": peaks.description or peaks.device},
                "summary": summary, "rounds": rounds}  # fmt: skip
        (args.out / "raw.json.gz").write_bytes(gzip.compress(json.dumps(data, indent=1).encode(), mtime=0))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
