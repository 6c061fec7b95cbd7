"""The run loop: one run (closed loop or Poisson arrivals), a point's repeats across targets, sweeps and searches.

Order, so that machine drift (thermal, other tenants, a filling cache) hits every target
alike: a point runs round (repeat) 1 on every target (A, B, C), then round 2 on every target in
the reverse order (C, B, A), and only then the next point starts — never all of one target, then
another. A point's runs share nothing but the seed scheme: run (step, repeat) gets
`derive_seed(seed, step, repeat)` for its prompts, lengths and arrival times, the same on every
target, so a round's runs can be set beside each other (`phasescope.bench.rounds`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from phasescope.bench.config import BenchConfig
from phasescope.bench.hardware import MetricsSampler, gauge_view, server_view, speculative_view
from phasescope.bench.saturation import check_saturation
from phasescope.bench.search import BracketSearch
from phasescope.bench.slo import goodput, meets
from phasescope.bench.spread import combine_runs
from phasescope.bench.summary import summarize
from phasescope.bench.targets import Target
from phasescope.bench.workload import BenchRequest, RequestRecord, derive_seed, workload
from phasescope.telemetry.exposition import Samples, fetch_samples

logger = logging.getLogger(__name__)

WARMUP_CONCURRENCY = 4


async def _one(target: Target, request: BenchRequest) -> RequestRecord:
    record = RequestRecord(request.index, time.perf_counter())
    try:
        await target.stream(request, record)
    except Exception as exc:  # any failure is counted in the results, never fatal to the sweep
        record.error = f"{type(exc).__name__}: {exc}"[:300]
    record.finished = time.perf_counter()
    return record


async def run_point(
    target: Target, requests: list[BenchRequest], *, concurrency: int | None, rate: float | None, seed: int,
    progress: Callable[[], None], burst: int | None = None,
) -> tuple[list[RequestRecord], float]:  # fmt: skip
    """Closed loop at `concurrency`, Poisson arrivals at `rate` requests/s, or waves of `burst` requests sent
    at once (the next wave when the last request of the previous one ends); the records and the duration."""
    started = time.perf_counter()
    records: list[RequestRecord] = []
    if burst is not None:
        for first in range(0, len(requests), burst):
            wave = requests[first : first + burst]
            records.extend(await asyncio.gather(*(_one(target, request) for request in wave)))
            for _ in wave:
                progress()
    elif concurrency is not None:
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


def record_json(record: RequestRecord, start: float, slo: dict[str, float], token_times: bool) -> dict[str, Any]:
    """One request as written into the results: times in seconds from the run's start."""

    def ms(seconds: float | None) -> float | None:
        return round(seconds * 1e3, 3) if seconds is not None else None

    row: dict[str, Any] = {
        "index": record.index,
        "sent": round(record.sent - start, 6),
        "finished": round(record.finished - start, 6),
        "prompt_tokens": record.prompt_tokens,
        "output_tokens": record.output_tokens,
        "ttft_ms": ms(record.ttft),
        "tpot_ms": ms(record.tpot),
        "e2e_ms": ms(record.e2e),
        "error": record.error,
    }
    if slo:
        row["met_slo"] = meets(record, slo)
    if token_times:
        row["token_times"] = [round(t - start, 6) for t in record.token_times]
    return row


async def _counters(target: Target) -> Samples | None:
    """The target's /metrics now, for counter deltas over a run (read before and after it, outside its timed and
    CPU windows); None when it has none. A failed read of phasescope's fails the run, as it always has; of another
    server's (read for speculative decoding's counters only) it leaves those figures out, with a warning."""
    url = target.metrics_url or target.scrape_url
    if not url:
        return None
    try:
        return await asyncio.to_thread(fetch_samples, url)
    except (OSError, ValueError) as exc:
        if target.metrics_url:
            raise
        logger.warning("reading %s failed: %s", url, exc)
        return None


async def run_once(
    target: Target, load: str, value: float, requests: list[BenchRequest], config: BenchConfig, *, seed: int,
    repeat: int,
) -> dict[str, Any]:  # fmt: skip
    """One run of a point on one target: its figures, goodput, saturation check, server view and records."""
    from tqdm import tqdm

    before = await _counters(target)
    cpu_before = target.frontend_cpu_seconds()
    label = f"{target.name} {load}={value:g} #{repeat + 1}"
    sampler = None
    if target.scrape_url:
        # Every server with a /metrics is read alike: its exposition's cost lands in its own front-end CPU.
        sampler = MetricsSampler(target.scrape_url, config.scrape_interval, gauges=target.metrics_url is not None)
    with tqdm(total=len(requests), desc=label, unit="req", leave=False) as bar:
        async with contextlib.AsyncExitStack() as stack:
            if sampler:
                await stack.enter_async_context(sampler)
            start = time.perf_counter()
            records, duration = await run_point(
                target, requests, concurrency=int(value) if load == "concurrency" else None,
                rate=value if load == "rate" else None, seed=seed, progress=lambda: bar.update(1),
                burst=int(value) if load == "burst" else None,
            )  # fmt: skip
    cpu_after = target.frontend_cpu_seconds()
    run: dict[str, Any] = {"repeat": repeat, "seed": seed, **summarize(records, duration)}
    run.update(goodput(records, duration, config.slo))
    if cpu_before is not None and cpu_after is not None and run["total_output_tokens"]:
        run["frontend_cpu_seconds"] = cpu_after - cpu_before
        run["frontend_cpu_seconds_per_1k_tokens"] = (cpu_after - cpu_before) / (run["total_output_tokens"] / 1e3)
    if sampler:
        run["metrics_reads"] = sampler.reads
    after = await _counters(target) if before is not None else None
    if before is not None and after is not None:
        # Any server's speculative decoding (phasescope's counters or vLLM's); the rest is phasescope's alone.
        run.update(speculative_view(before, after))
        if target.metrics_url and sampler:
            run.update(server_view(before, after, duration))
            run.update(gauge_view(sampler.snapshots))
    saturation = check_saturation(records)
    run["saturation"] = saturation.to_dict()
    run["records"] = [record_json(r, start, config.slo, config.token_times) for r in records]
    good = f"  goodput {run['goodput_ratio']:5.1%}" if config.slo else ""
    flag = "  over-saturated" if saturation.over_saturated else ""
    rate = run.get("speculative_acceptance_rate")
    accepted = f"  accepted {rate:5.1%}" if rate is not None else ""
    print(
        f"{label:>28} {run['output_throughput']:8.1f} tok/s  TTFT p50 {run['median_ttft_ms']:8.1f} ms  "
        f"TPOT p50 {run['median_tpot_ms']:7.1f} ms{good}{accepted}  errors {run['errors']}{flag}",
        flush=True,
    )
    return run


def combine_point(target: str, load: str, value: float, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A point from its runs: medians under vLLM's names, `spread`, the saturation verdict and the runs."""
    figures = [{k: v for k, v in run.items() if k not in ("repeat", "seed", "saturation", "records")} for run in runs]
    flagged = [run["saturation"] for run in runs if run["saturation"]["over_saturated"]]
    # Over-saturated when at least half the repeats say so: one noisy repeat of two is enough to stop.
    saturation = {
        "over_saturated": 2 * len(flagged) >= len(runs),
        "runs_flagged": len(flagged),
        "reasons": list(dict.fromkeys(reason for check in flagged for reason in check["reasons"])),
    }
    return {"target": target, "load": load, "value": value, "repeats": len(runs), **combine_runs(figures),
            "saturation": saturation, "runs": runs}  # fmt: skip


class Bench:
    """Runs points against every target, interleaved; collects the points and how each target's plan ended."""

    def __init__(self, config: BenchConfig, targets: Sequence[Target]) -> None:
        self.config = config
        self.targets = list(targets)
        self.points: list[dict[str, Any]] = []
        self.plans: dict[str, dict[str, Any]] = {t.name: {"target": t.name} for t in self.targets}

    async def point(self, step: int, load: str, values: dict[str, float]) -> list[dict[str, Any]]:
        """One point on each target in `values` (name → load): repeat by repeat, target by target, the targets'
        order reversed on every odd repeat (A B, B A, A B, ...). A target run straight after another meets what
        that one left behind (its engine's processes winding down on the same CPUs, a warm or cold cache), so a
        fixed order would charge it to the same target every time; with an even number of repeats each target
        runs first and second equally often."""
        config = self.config
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in values}
        for repeat in range(config.repeats):
            seed = derive_seed(config.seed, step, repeat)
            requests = workload(config.workload, seed, config.warmup + config.requests)
            warmup, measured = requests[: config.warmup], requests[config.warmup :]
            for target in self.targets if repeat % 2 == 0 else reversed(self.targets):
                if target.name not in values:
                    continue
                if repeat == 0 and warmup:
                    await run_point(target, warmup, concurrency=min(len(warmup), WARMUP_CONCURRENCY), rate=None,
                                    seed=seed, progress=lambda: None)  # fmt: skip
                if len(values) > 1:
                    # The target that ran last keeps spinning for a moment (vLLM's shared-memory queue readers poll
                    # for a second after their last message) on the CPUs the next one needs: let it go idle first.
                    await asyncio.sleep(config.settle_seconds)
                value = values[target.name]
                runs[target.name].append(await run_once(target, load, value, measured, config, seed=seed,
                                                         repeat=repeat))  # fmt: skip
        points = [combine_point(name, load, values[name], target_runs) for name, target_runs in runs.items()]
        self.points.extend(points)
        return points

    async def sweep(self) -> None:
        """The fixed points; a target's rate sweep stops at its first over-saturated point."""
        stopped: dict[str, dict[str, Any]] = {}
        for step, (load, value) in enumerate(self.config.points):
            active = [t.name for t in self.targets if not (load == "rate" and t.name in stopped)]
            for name in stopped:
                if load == "rate":
                    stopped[name]["skipped"].append(value)
            if not active:
                continue
            for point in await self.point(step, load, dict.fromkeys(active, value)):
                if load == "rate" and self.config.saturation_stop and point["saturation"]["over_saturated"]:
                    stopped[point["target"]] = {"load": load, "value": value,
                                                "reasons": point["saturation"]["reasons"], "skipped": []}  # fmt: skip
        for name, plan in self.plans.items():
            plan["mode"] = "sweep"
            plan["saturation_stop"] = stopped.get(name)

    async def search(self) -> None:
        """One bracketing search per target (phasescope.bench.search), stepped together."""
        config = self.config
        assert config.sla_search is not None
        load = config.sla_search
        searches = {
            t.name: BracketSearch(config.search_start, config.max_points, integer=load == "concurrency",
                                  factor=config.search_factor, tolerance=config.search_tolerance)
            for t in self.targets
        }  # fmt: skip
        by_value: dict[tuple[str, float], dict[str, Any]] = {}
        step = 0
        while True:
            values = {name: value for name, s in searches.items() if (value := s.next_load()) is not None}
            if not values:
                break
            for point in await self.point(step, load, values):
                point["search_passed"] = point["goodput_ratio"] >= config.goodput_target
                searches[point["target"]].record(point["value"], point["search_passed"])
                by_value[(point["target"], point["value"])] = point
            step += 1
        for name, search in searches.items():
            result = search.result()
            answer = by_value.get((name, search.passing)) if search.passing is not None else None
            if answer is not None:
                result["goodput_ratio_at_answer"] = answer["spread"]["goodput_ratio"]
                result["answer_over_saturated"] = answer["saturation"]["over_saturated"]
            failing = by_value.get((name, search.failing)) if search.failing is not None else None
            if failing is not None:
                result["goodput_ratio_at_first_failing"] = failing["spread"]["goodput_ratio"]
            self.plans[name].update({"mode": "search", "load": load, "goodput_target": config.goodput_target,
                                     **result})  # fmt: skip
