"""The step telemetry's CPU per engine step with every cache warm: vLLM's stats objects in, every sink out.

`loadtests/front_end_step_cost.py` measures the step telemetry inside a loaded server, where it runs
between the output processor's passes with its caches cold; this runs the same code in a loop, so a
change to it shows without a server's noise. vLLM-shaped stats updates (`SchedulerStats` with its
iteration details and perf stats, `IterationStats` with one inter-token gap per decoding request) go
through `PhasescopeStatLogger` into a `StepAggregator` holding reports as the server does
(`STEP_REPORT_BATCH`), with its Prometheus export and the live latencies as sinks. Printed: the
engine thread's part (the logger and the hold), the hand-over's part (every `STEP_REPORT_BATCH` steps), and
their sum, µs per step, each the median of the repeats.

    .venv/bin/python -m loadtests.step_telemetry_warm --batch 16 --mixed-every 8
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from types import SimpleNamespace
from typing import Any

from prometheus_client import CollectorRegistry
from vllm.v1.metrics.perf import PerfStats
from vllm.v1.metrics.stats import IterationStats, SchedulerIterationDetails, SchedulerStats

from phasescope.engine.vllm.stats import PhasescopeStatLogger
from phasescope.serve.app import STEP_REPORT_BATCH
from phasescope.telemetry.hardware.peaks import HardwarePeaks
from phasescope.telemetry.live import RecentLatencies
from phasescope.telemetry.model.cost import model_cost_from_config
from phasescope.telemetry.step.aggregator import StepAggregator
from phasescope.telemetry.step.prometheus import StepMetrics
from phasescope.telemetry.step.records import StepForwarder

PEAKS = HardwarePeaks("toy", 100e9, {"fp32": 1e12}, "measured", "toy device")
COST = model_cost_from_config(
    {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 2, "head_dim": 64},
    parameter_count=6_700_000,
    dtype="float32",
)


def updates(steps: int, batch: int, mixed_every: int, seed: int) -> list[tuple[SchedulerStats, IterationStats]]:
    """Decode steps of `batch` requests, every `mixed_every`-th one with a new request's 40-token prompt beside them."""
    rng = random.Random(seed)
    made = []
    for index in range(steps):
        mixed = mixed_every > 0 and index % mixed_every == 0
        decoding = batch - 1 if mixed else batch
        scheduler = SchedulerStats(
            num_running_reqs=batch,
            kv_cache_usage=0.3,
            iteration_details=SchedulerIterationDetails(
                iteration_index=index,
                num_ctx_requests=int(mixed),
                num_ctx_tokens=40 if mixed else 0,
                num_generation_requests=decoding,
                num_generation_tokens=decoding,
                elapsed_ms=8.0 + rng.random(),
            ),
            perf_stats=PerfStats(
                num_flops_per_gpu=10**9, num_read_bytes_per_gpu=5 * 10**8, num_write_bytes_per_gpu=10**6
            ),
        )
        iteration = IterationStats()  # type: ignore[no-untyped-call]  # vLLM leaves its __init__ unannotated
        iteration.inter_token_latencies_iter = [0.008 + rng.random() * 0.001 for _ in range(decoding)]
        made.append((scheduler, iteration))
    return made


def measure(args: argparse.Namespace) -> dict[str, float]:
    forward = StepForwarder()
    aggregator = StepAggregator(COST, "float32", PEAKS, sinks=(RecentLatencies(),), batch_reports=10**9)
    StepMetrics("tiny", aggregator, CollectorRegistry())
    # Each part to its own sink too: a checkout from before `StepForwarder.report` hands them on that way.
    forward.sink = aggregator.record
    forward.iteration_sink = aggregator.record_iteration
    forward.queue_sink = aggregator.record_queue
    forward.report_sink = aggregator.record_report
    # As served: the report built when the batch is handed on (ignored by a checkout from before report_held).
    forward.held_sink = aggregator.record_held
    config: Any = SimpleNamespace(
        cache_config=SimpleNamespace(num_gpu_blocks=1000, block_size=16),
        scheduler_config=SimpleNamespace(max_num_seqs=128, max_num_batched_tokens=2048),
        speculative_config=None,
    )
    logger = PhasescopeStatLogger(config, 0, forward)
    made = updates(STEP_REPORT_BATCH, args.batch, args.mixed_every, args.seed)
    engine_side: list[float] = []
    hand_over: list[float] = []
    steps = args.batches * len(made)
    for repeat in range(args.repeats + 1):
        held = handed = 0.0
        for _ in range(args.batches):
            # One hand-over's worth held, as the engine's thread pays for it, then handed on.
            started = time.process_time()
            for scheduler, iteration in made:
                logger.record(scheduler, iteration)
            middle = time.process_time()
            aggregator.flush_reports()
            held += middle - started
            handed += time.process_time() - middle
        if repeat:  # the first warms the caches
            engine_side.append(held / steps * 1e6)
            hand_over.append(handed / steps * 1e6)
    engine = statistics.median(engine_side)
    handed = statistics.median(hand_over)
    return {"engine_thread_us_per_step": engine, "hand_over_us_per_step": handed, "total_us_per_step": engine + handed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--batch", type=int, default=16, help="requests decoding per step")
    parser.add_argument("--mixed-every", type=int, default=8, help="one step in N carries a prompt chunk (0: none)")
    parser.add_argument("--batches", type=int, default=40, help="hand-overs of STEP_REPORT_BATCH steps per repeat")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    for name, value in measure(args).items():
        print(f"{name}: {value:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
