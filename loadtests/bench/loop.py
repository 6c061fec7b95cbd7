"""The run loop: one load point (closed loop or Poisson arrivals), and a sweep of points against one target."""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from loadtests.bench.summary import server_view, summarize
from loadtests.bench.targets import Target
from loadtests.bench.workload import BenchRequest, RequestRecord, workload
from telemetry.exposition import fetch_samples


async def _one(target: Target, request: BenchRequest) -> RequestRecord:
    record = RequestRecord(request.index, time.perf_counter())
    try:
        await target.stream(request, record)
    except Exception as exc:  # any failure is counted in the results, never fatal to the sweep
        record.error = f"{type(exc).__name__}: {exc}"[:300]
    return record


async def run_point(
    target: Target, requests: list[BenchRequest], *, concurrency: int | None, rate: float | None, seed: int,
    progress: Callable[[], None],
) -> tuple[list[RequestRecord], float]:  # fmt: skip
    """Closed loop at `concurrency`, or Poisson arrivals at `rate` requests/s."""
    started = time.perf_counter()
    records: list[RequestRecord] = []
    if concurrency is not None:
        queue = list(reversed(requests))

        async def client() -> None:
            while queue:
                records.append(await _one(target, queue.pop()))
                progress()

        await asyncio.gather(*(client() for _ in range(concurrency)))
    else:
        assert rate is not None
        rng = random.Random(seed)
        tasks = []
        for request in requests:
            tasks.append(asyncio.create_task(_one(target, request)))
            tasks[-1].add_done_callback(lambda _: progress())
            await asyncio.sleep(rng.expovariate(rate))
        records = list(await asyncio.gather(*tasks))
    return records, time.perf_counter() - started


async def sweep(
    target: Target, points: list[tuple[str, float]], args: argparse.Namespace, results: list[dict[str, Any]]
) -> None:
    from tqdm import tqdm

    requests = workload(args.seed, args.warmup + args.requests, args.max_tokens)
    warmup, measured = requests[: args.warmup], requests[args.warmup :]
    for kind, value in points:
        if warmup:
            await run_point(
                target, warmup, concurrency=min(len(warmup), 4), rate=None, seed=args.seed, progress=lambda: None
            )
        metrics_url = getattr(target, "metrics_url", None)
        before = fetch_samples(metrics_url) if metrics_url else {}
        cpu_before = target.frontend_cpu_seconds()
        with tqdm(total=len(measured), desc=f"{target.name} {kind}={value:g}", unit="req", leave=False) as bar:
            records, duration = await run_point(
                target, measured, concurrency=int(value) if kind == "concurrency" else None,
                rate=value if kind == "rate" else None, seed=args.seed, progress=lambda: bar.update(1),
            )  # fmt: skip
        cpu_after = target.frontend_cpu_seconds()
        summary = summarize(records, duration)
        point: dict[str, Any] = {"target": target.name, "load": kind, "value": value, **summary}
        if cpu_before is not None and cpu_after is not None and summary["total_output_tokens"]:
            point["frontend_cpu_seconds"] = cpu_after - cpu_before
            point["frontend_cpu_seconds_per_1k_tokens"] = (cpu_after - cpu_before) / (
                summary["total_output_tokens"] / 1e3
            )
        if metrics_url:
            point.update(server_view(before, fetch_samples(metrics_url), duration))
        point["records"] = [asdict(r) for r in records]
        results.append(point)
        print(
            f"{target.name:>12} {kind}={value:<6g} {summary['output_throughput']:8.1f} tok/s  "
            f"TTFT p50 {summary['median_ttft_ms']:8.1f} ms  TPOT p50 {summary['median_tpot_ms']:7.1f} ms  "
            f"errors {summary['errors']}",
            flush=True,
        )
