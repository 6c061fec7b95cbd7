"""Decode's operating point with prompts arriving beside it: the marginal-cost split vs a token-share split.

Runs the embedded default in-process (the server's own `VllmEngine` and stat
logger), lets four streams decode alone, then sends long prompts one after
another so chunked prefill mixes them into the decode steps. Every step the
engine reports is attributed both ways; decode's arithmetic intensity
(FLOPs ÷ bytes moved) is printed for the decode-only period and for the
period with prompts. A split that keeps decode's operating point true gives
about the same figure in both.

    .venv/bin/python -m loadtests.phase_split [--prompts 3] [--prompt-tokens 250] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import time
from contextlib import aclosing
from pathlib import Path
from typing import Any

from phasescope.bench.harness import stop_on_sigterm, write_results
from phasescope.engine.default_model import DEFAULT_MODEL_NAME, ensure_default_model
from phasescope.engine.request import SamplingSpec
from phasescope.serve.config import Settings
from phasescope.telemetry.model.cost import ModelCost
from phasescope.telemetry.pipeline import TelemetryPipeline
from phasescope.telemetry.step.attribution import attribute_step
from phasescope.telemetry.step.records import StepForwarder, StepRecord, StepReport

DECODERS = 4


def decode_intensities(
    steps: list[StepRecord], cost: ModelCost, bandwidth: float, flops: float
) -> dict[str, float | dict[str, int]]:
    """Decode's FLOPs ÷ bytes moved over `steps`, by the project's marginal-cost rule and by token share."""
    marginal_flops = marginal_bytes = share_flops = share_bytes = 0.0
    kinds: dict[str, int] = {}
    for step in steps:
        kinds[step.kind] = kinds.get(step.kind, 0) + 1
        attributed = attribute_step(step, cost, bandwidth, flops)
        decode = attributed.shares["decode"]
        marginal_flops += decode.flops
        marginal_bytes += decode.moved_bytes
        # The split this replaces: every quantity in proportion to the phases' token counts.
        share = step.decode_tokens / (step.prefill_tokens + step.decode_tokens)
        share_flops += attributed.flops * share
        share_bytes += (attributed.read_bytes + attributed.written_bytes) * share
    return {
        "steps": kinds,
        "marginal_cost_flops_per_byte": marginal_flops / marginal_bytes if marginal_bytes else 0.0,
        "token_share_flops_per_byte": share_flops / share_bytes if share_bytes else 0.0,
    }


async def measure(prompts: int, prompt_tokens: int, decode_seconds: float) -> dict[str, Any]:
    from phasescope.engine.vllm.engine import VllmEngine

    recorded: list[tuple[float, StepRecord]] = []

    def keep(report: StepReport) -> None:
        if report.step is not None:
            recorded.append((time.monotonic(), report.step))

    forward = StepForwarder()
    forward.sink = keep
    # The server's own engine, configured as `phasescope serve` configures it (vLLM's own series, held in the
    # pipeline, are not read here).
    settings = Settings(enforce_eager=True, max_model_len=2048, kv_cache_gib=1.0)
    engine = await asyncio.to_thread(
        VllmEngine.start, settings.engine_options(), str(ensure_default_model()), DEFAULT_MODEL_NAME, forward,
        TelemetryPipeline(),
    )  # fmt: skip
    try:
        stop = asyncio.Event()
        all_decoding = asyncio.Event()
        decoding: set[int] = set()

        async def decoder(index: int) -> None:
            spec = SamplingSpec(max_tokens=2_000, ignore_eos=True)
            async with aclosing(engine.generate(f"decode-{index}", [100 + index, 200, 300], spec)) as steps:
                async for _ in steps:
                    decoding.add(index)
                    if len(decoding) == DECODERS:
                        all_decoding.set()
                    if stop.is_set():
                        return

        tasks = [asyncio.create_task(decoder(index)) for index in range(DECODERS)]
        await all_decoding.wait()
        started = time.monotonic()
        await asyncio.sleep(decode_seconds)
        prompts_from = time.monotonic()
        rng = random.Random(1)
        for index in range(prompts):
            prompt = [rng.randrange(1_000, 40_000) for _ in range(prompt_tokens)]
            async for _ in engine.generate(f"prompt-{index}", prompt, SamplingSpec(max_tokens=1)):
                pass
        ended = time.monotonic()
        stop.set()
        await asyncio.gather(*tasks)
        cost = engine.description.cost
    finally:
        await engine.close()
    # Peaks weigh only the split of a mixed step's time, which intensity does not use.
    bandwidth, flops = 15.31e9, 82.04e9
    return {
        "decoders": DECODERS,
        "decode_only": decode_intensities(
            [s for t, s in recorded if started < t <= prompts_from], cost, bandwidth, flops
        ),
        "with_prompts": decode_intensities(
            [s for t, s in recorded if prompts_from < t <= ended], cost, bandwidth, flops
        ),
    }


def main() -> None:
    stop_on_sigterm()  # the servers and engines it starts are stopped on SIGTERM too
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=250)
    parser.add_argument("--decode-seconds", type=float, default=4.0)
    parser.add_argument("--json", type=Path, help="also write the results here (gzipped if it ends in .gz)")
    args = parser.parse_args()
    # The command that repeats this run: every setting (defaults too) and where the results went.
    command = ["python", "-m", "loadtests.phase_split", "--prompts", str(args.prompts),
               "--prompt-tokens", str(args.prompt_tokens), "--decode-seconds", f"{args.decode_seconds:g}"]  # fmt: skip
    if args.json:
        command += ["--json", str(args.json)]
    measured = asyncio.run(measure(args.prompts, args.prompt_tokens, args.decode_seconds))
    result = {"command": shlex.join(command), **measured}
    print(json.dumps(result, indent=2))
    if args.json:
        write_results(args.json, result, indent=2)


if __name__ == "__main__":
    main()
