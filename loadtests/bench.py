"""`phasescope bench`: seeded load sweeps with vLLM `bench serve`-style results, plots, and side-by-side comparisons.

Load shapes: fixed concurrency (closed loop: C clients, each sends its next
request when the last one ends) and Poisson arrivals (open loop: exponential
gaps at a given rate). Every point sends `--warmup` requests first (excluded),
then `--requests` measured ones from a seeded workload; prompts differ per
request (a seeded preamble) so the prefix cache does not flatter TTFT.

Definitions (the formulas are printed with the results):
  TTFT  = first streamed token − send
  TPOT  = (E2E − TTFT) ÷ (output tokens − 1), per request
  ITL   = every gap between consecutive token arrivals, pooled over requests
  E2E   = last token − send
  output_throughput = Σ output tokens ÷ duration; total_token_throughput adds prompt tokens
  front-end CPU = user + system seconds of the serving front-end process only
                  (not its engine-core processes) per 1,000 streamed tokens

`--compare` runs the same workload, in the same run, against (a) vLLM's AsyncLLM
in this process (no network: the engine's own limit), (b) vLLM's OpenAI server
and (c) phasescope, all on the same model and engine settings, and prints
phasescope ÷ in-process and phasescope ÷ OpenAI server at every point.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from telemetry.exposition import Samples, fetch_samples, sum_samples

FORMULAS = {
    "ttft": "TTFT = first streamed token − send",
    "tpot": "TPOT = (E2E − TTFT) ÷ (output tokens − 1), per request",
    "itl": "ITL = each gap between consecutive token arrivals, pooled",
    "e2el": "E2E = last token − send",
    "output_throughput": "Σ output tokens ÷ duration",
    "request_throughput": "completed requests ÷ duration",
    "total_token_throughput": "Σ (prompt + output tokens) ÷ duration",
    "frontend_cpu_seconds_per_1k_tokens": "front-end process user+system CPU seconds ÷ (streamed tokens ÷ 1000)",
}
WORDS = [
    "lighthouse",
    "harbour",
    "orbit",
    "lantern",
    "meadow",
    "circuit",
    "glacier",
    "violin",
    "compass",
    "ember",
    "quartz",
    "saddle",
    "canyon",
    "ribbon",
    "falcon",
    "walnut",
    "prism",
    "tundra",
    "anchor",
    "velvet",
]


@dataclass(frozen=True)
class BenchRequest:
    index: int
    prompt: str
    max_tokens: int


@dataclass
class RequestRecord:
    index: int
    sent: float
    token_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.sent if self.token_times else None

    @property
    def e2e(self) -> float | None:
        return self.token_times[-1] - self.sent if self.token_times else None


def workload(seed: int, count: int, max_tokens: int) -> list[BenchRequest]:
    """Seeded requests: a varied preamble (so prefix caching cannot reuse it) and a task."""
    rng = random.Random(seed)
    tasks = ("Tell a story about", "Describe in detail", "Write a poem about", "Explain how to build")
    requests = []
    for index in range(count):
        preamble = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40)))
        requests.append(
            BenchRequest(index, f"[{index}] {preamble}. {rng.choice(tasks)} a {rng.choice(WORDS)}.", max_tokens)
        )
    return requests


class Target(Protocol):
    name: str

    async def stream(self, request: BenchRequest, record: RequestRecord) -> None: ...

    def frontend_cpu_seconds(self) -> float | None: ...


def _cpu(pid: int | None) -> float | None:
    if pid is None:
        return None
    import psutil

    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


class PhasescopeTarget:
    def __init__(self, address: str, metrics_url: str | None, pid: int | None) -> None:
        import grpc

        from phasescope.v1 import inference_pb2_grpc as pb_grpc

        self.name = "phasescope"
        self.address = address
        self.metrics_url = metrics_url
        self._pid = pid
        self._channel = grpc.aio.insecure_channel(address)
        self._stub = pb_grpc.InferenceStub(self._channel)

    async def stream(self, request: BenchRequest, record: RequestRecord) -> None:
        from server.client import build_request

        call: Any = self._stub.GenerateStream(
            build_request(prompt=request.prompt, max_tokens=request.max_tokens, ignore_eos=True, temperature=0.0),
            timeout=600,
        )
        async for chunk in call:
            now = time.perf_counter()
            record.token_times.extend([now] * len(chunk.token_ids))
            record.output_tokens += len(chunk.token_ids)
            if chunk.HasField("usage"):
                record.prompt_tokens = chunk.usage.prompt_tokens

    def frontend_cpu_seconds(self) -> float | None:
        return _cpu(self._pid)


class OpenAITarget:
    def __init__(self, base_url: str, model: str, pid: int | None) -> None:
        import aiohttp

        self.name = "vllm-openai"
        self._url = f"{base_url}/v1/completions"
        self._model = model
        self._pid = pid
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600))

    async def stream(self, request: BenchRequest, record: RequestRecord) -> None:
        body = {
            "model": self._model,
            "prompt": request.prompt,
            "max_tokens": request.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with self._session.post(self._url, json=body) as response:
            response.raise_for_status()
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                data = json.loads(line[6:])
                if data.get("usage"):
                    record.prompt_tokens = data["usage"]["prompt_tokens"]
                    # Chunks may carry more than one token; usage has the exact count.
                    missing = data["usage"]["completion_tokens"] - record.output_tokens
                    if missing > 0 and record.token_times:
                        record.token_times.extend([record.token_times[-1]] * missing)
                        record.output_tokens += missing
                for choice in data.get("choices", []):
                    if choice.get("text"):
                        record.token_times.append(now)
                        record.output_tokens += 1

    def frontend_cpu_seconds(self) -> float | None:
        return _cpu(self._pid)

    async def close(self) -> None:
        await self._session.close()


class InProcessTarget:
    """vLLM's AsyncLLM in this process: no network, no serialisation: the engine's own limit."""

    def __init__(self, llm: Any) -> None:
        self.name = "in-process"
        self._llm = llm

    async def stream(self, request: BenchRequest, record: RequestRecord) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA
        )
        async for output in self._llm.generate(request.prompt, params, f"bench-{request.index}-{time.monotonic_ns()}"):
            now = time.perf_counter()
            count = len(output.outputs[0].token_ids)
            record.token_times.extend([now] * count)
            record.output_tokens += count
            record.prompt_tokens = len(output.prompt_token_ids or [])

    def frontend_cpu_seconds(self) -> float | None:
        return None


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


def _percentiles(prefix: str, values_seconds: list[float]) -> dict[str, float]:
    if not values_seconds:
        return {f"{kind}_{prefix}_ms": 0.0 for kind in ("mean", "median", "std", "p90", "p95", "p99", "max")}
    ms = sorted(v * 1e3 for v in values_seconds)

    def pct(p: float) -> float:
        return ms[min(len(ms) - 1, round(p / 100 * (len(ms) - 1)))]

    return {
        f"mean_{prefix}_ms": statistics.fmean(ms),
        f"median_{prefix}_ms": statistics.median(ms),
        f"std_{prefix}_ms": statistics.pstdev(ms),
        f"p90_{prefix}_ms": pct(90),
        f"p95_{prefix}_ms": pct(95),
        f"p99_{prefix}_ms": pct(99),
        f"max_{prefix}_ms": ms[-1],
    }


def summarize(records: list[RequestRecord], duration: float) -> dict[str, Any]:
    done = [r for r in records if not r.error and r.token_times]
    output = sum(r.output_tokens for r in done)
    prompt = sum(r.prompt_tokens for r in done)
    ttfts = [r.ttft for r in done if r.ttft is not None]
    tpots = [
        (r.e2e - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1 and r.e2e and r.ttft is not None
    ]
    itls = [b - a for r in done for a, b in zip(r.token_times, r.token_times[1:], strict=False) if b > a]
    e2es = [r.e2e for r in done if r.e2e is not None]
    summary: dict[str, Any] = {
        "completed": len(done),
        "errors": len([r for r in records if r.error]),
        "timeouts": len([r for r in records if "Timeout" in r.error or "DEADLINE" in r.error]),
        "duration": duration,
        "total_input_tokens": prompt,
        "total_output_tokens": output,
        "request_throughput": len(done) / duration,
        "output_throughput": output / duration,
        "total_token_throughput": (output + prompt) / duration,
    }
    for prefix, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2es)):
        summary.update(_percentiles(prefix, values))
    return summary


def server_view(before: Samples, after: Samples, duration: float) -> dict[str, float]:
    """The server's own account of the same window, from counter deltas."""

    def delta(name: str, **labels: str) -> float:
        return sum_samples(after, name, **labels) - sum_samples(before, name, **labels)

    view: dict[str, float] = {}
    for phase in ("frontend", "queue", "prefill", "decode"):
        count = delta("phasescope_request_phase_seconds_count", phase=phase)
        total = delta("phasescope_request_phase_seconds_sum", phase=phase)
        view[f"server_mean_{phase}_ms"] = total / count * 1e3 if count else 0.0
    view["server_requests_without_first_token"] = delta("phasescope_requests_without_first_token_total")
    peak_bandwidth = sum_samples(after, "phasescope_hardware_peak_memory_bandwidth_bytes_per_second")
    peak_flops = sum_samples(after, "phasescope_hardware_peak_flops")
    # Over the point's wall time, per engine average (peaks are per engine).
    engines = max(1, len({dict(ls).get("engine") for (n, ls) in after if n == "phasescope_engine_requests"}))

    def bandwidth_saturation(moved: float) -> float:
        return moved / duration / engines / peak_bandwidth if peak_bandwidth else 0.0

    def compute_utilization(flops: float) -> float:
        return flops / duration / engines / peak_flops if peak_flops else 0.0

    device_moved = device_flops = 0.0
    for phase in ("prefill", "decode"):
        view[f"server_{phase}_tokens_per_second"] = delta("phasescope_tokens_total", phase=phase) / duration
        moved = delta("phasescope_model_bytes_read_total", phase=phase) + delta(
            "phasescope_model_written_bytes_total", phase=phase
        )
        flops = delta("phasescope_model_flops_total", phase=phase)
        device_moved, device_flops = device_moved + moved, device_flops + flops
        # Each phase's part of the device's figures (docs/metrics.md).
        view[f"server_{phase}_bandwidth_saturation"] = bandwidth_saturation(moved)
        view[f"server_{phase}_compute_utilization"] = compute_utilization(flops)
    view["server_device_bandwidth_saturation"] = bandwidth_saturation(device_moved)
    # Compute idleness is the device's: 1 − MFU of all steps.
    view["server_device_compute_idleness"] = 1.0 - compute_utilization(device_flops)
    return view


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class ManagedProcess:
    """A server this harness started, in its own process group, stopped (engine included) on exit."""

    def __init__(self, command: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.log = log
        self._log = log.open("wb")
        self.process = subprocess.Popen(
            command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )

    def wait_until(self, ready: Callable[[], bool], what: str, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"{what} exited with {self.process.returncode}; see {self.log}")
            with contextlib.suppress(Exception):
                if ready():
                    return
            time.sleep(1)
        raise SystemExit(f"{what} not ready after {timeout:.0f} s; see {self.log}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=90)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self._log.close()


@dataclass
class EngineSettings:
    model: str
    served_name: str
    dtype: str
    max_model_len: int
    kv_cache_gib: float
    max_num_seqs: int


def start_phasescope(
    settings: EngineSettings, log: Path, extra_args: tuple[str, ...] = ()
) -> tuple[ManagedProcess, PhasescopeTarget]:
    from server.client import PhasescopeClient

    port, metrics_port = free_port(), free_port()
    command = [
        sys.executable, "-m", "server", "serve", "--enforce-eager", "--model", settings.model,
        "--served-model-name", settings.served_name, "--dtype", settings.dtype,
        "--max-model-len", str(settings.max_model_len), "--kv-cache-gib", str(settings.kv_cache_gib),
        "--max-concurrent-requests", str(settings.max_num_seqs), "--max-queued-requests", "4096",
        "--port", str(port), "--metrics-port", str(metrics_port), *extra_args,
    ]  # fmt: skip
    managed = ManagedProcess(command, log)
    address = f"127.0.0.1:{port}"

    def serving() -> bool:
        with PhasescopeClient(address, timeout_seconds=2) as client:
            return client.health() == "SERVING"

    managed.wait_until(serving, "phasescope")
    return managed, PhasescopeTarget(address, f"http://127.0.0.1:{metrics_port}/metrics", managed.process.pid)


def start_openai(settings: EngineSettings, out: Path) -> tuple[ManagedProcess, OpenAITarget]:
    port = free_port()
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", settings.model,
        "--served-model-name", settings.served_name, "--dtype", settings.dtype, "--enforce-eager",
        "--max-model-len", str(settings.max_model_len), "--max-num-seqs", str(settings.max_num_seqs),
        "--kv-cache-memory-bytes", str(int(settings.kv_cache_gib * 2**30)),
        "--host", "127.0.0.1", "--port", str(port), "--disable-uvicorn-access-log",
    ]  # fmt: skip
    managed = ManagedProcess(command, out / "vllm-openai.log", env={"VLLM_LOGGING_LEVEL": "WARNING"})
    base = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        with urllib.request.urlopen(f"{base}/health", timeout=2) as response:
            return bool(response.status == 200)

    managed.wait_until(healthy, "vLLM's OpenAI server")
    return managed, OpenAITarget(base, settings.served_name, managed.process.pid)


def start_in_process(settings: EngineSettings) -> tuple[Any, InProcessTarget]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(
        model=settings.model, served_model_name=settings.served_name, dtype=settings.dtype,  # type: ignore[arg-type]
        max_model_len=settings.max_model_len, enforce_eager=True, max_num_seqs=settings.max_num_seqs,
        kv_cache_memory_bytes=int(settings.kv_cache_gib * 2**30), disable_log_stats=True,
    )  # fmt: skip
    llm = AsyncLLM.from_engine_args(args)
    return llm, InProcessTarget(llm)


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


def _save(plt: Any, figure: Any, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path


def plot(results: list[dict[str, Any]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    targets = sorted({r["target"] for r in results})
    figure, axes = plt.subplots(figsize=(7, 4.5), dpi=100)
    for name in targets:
        rows = [r for r in results if r["target"] == name]
        axes.plot([r["value"] for r in rows], [r["output_throughput"] for r in rows], marker="o", label=name)
    axes.set_xlabel("load (concurrency or requests/s)")
    axes.set_ylabel("output tokens/s (Σ output tokens ÷ duration)")
    axes.set_title("Throughput vs load")
    axes.legend()
    axes.grid(alpha=0.3)
    files.append(_save(plt, figure, out / "throughput.png"))

    figure, axes = plt.subplots(figsize=(7, 4.5), dpi=100)
    for name in targets:
        rows = [r for r in results if r["target"] == name and r["median_tpot_ms"] > 0]
        axes.plot(
            [r["output_throughput"] for r in rows], [1e3 / r["median_tpot_ms"] for r in rows], marker="o", label=name
        )
        for r in rows:
            axes.annotate(f"{r['value']:g}", (r["output_throughput"], 1e3 / r["median_tpot_ms"]), fontsize=7)
    axes.set_xlabel("total output tokens/s")
    axes.set_ylabel("tokens/s per user (1 ÷ median TPOT)")
    axes.set_title("Per-user vs total throughput (Pareto)")
    axes.legend()
    axes.grid(alpha=0.3)
    files.append(_save(plt, figure, out / "pareto.png"))

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5), dpi=100)
    for name in targets:
        rows = [r for r in results if r["target"] == name]
        for axes, metric in ((left, "ttft"), (right, "tpot")):
            for quantile, style in (("median", "-"), ("p99", "--")):
                axes.plot([r["value"] for r in rows], [r[f"{quantile}_{metric}_ms"] for r in rows], style, marker="o",
                          label=f"{name} {quantile}")  # fmt: skip
    left.set_title("TTFT vs load")
    right.set_title("TPOT vs load")
    for axes in (left, right):
        axes.set_xlabel("load")
        axes.set_ylabel("ms")
        axes.grid(alpha=0.3)
        axes.legend(fontsize=7)
    files.append(_save(plt, figure, out / "latency.png"))

    rows = [r for r in results if "server_mean_queue_ms" in r]
    if rows:
        figure, axes = plt.subplots(figsize=(7, 4.5), dpi=100)
        labels = [f"{r['value']:g}" for r in rows]
        bottom = [0.0] * len(rows)
        for phase in ("frontend", "queue", "prefill", "decode"):
            values = [r.get(f"server_mean_{phase}_ms", 0.0) for r in rows]
            axes.bar(labels, values, bottom=bottom, label=phase)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        axes.set_xlabel("load")
        axes.set_ylabel("mean ms per request (server's engine timestamps)")
        axes.set_title("Phase breakdown (phasescope)")
        axes.legend()
        files.append(_save(plt, figure, out / "phases.png"))
    return files


def ratios(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """phasescope ÷ in-process and ÷ vLLM's OpenAI server, per point."""
    table = []
    by = {(r["target"], r["load"], r["value"]): r for r in results}
    for (target, load, value), ours in sorted(by.items()):
        if target != "phasescope":
            continue
        row: dict[str, Any] = {"load": load, "value": value}
        for other in ("in-process", "vllm-openai"):
            theirs = by.get((other, load, value))
            if theirs and theirs["output_throughput"]:
                row[f"throughput_vs_{other}"] = ours["output_throughput"] / theirs["output_throughput"]
                row[f"median_ttft_ms_minus_{other}"] = ours["median_ttft_ms"] - theirs["median_ttft_ms"]
        cpu = ours.get("frontend_cpu_seconds_per_1k_tokens")
        openai = by.get(("vllm-openai", load, value), {}).get("frontend_cpu_seconds_per_1k_tokens")
        if cpu is not None and openai:
            row["frontend_cpu_vs_vllm-openai"] = cpu / openai
        table.append(row)
    return table


def default_settings(args: argparse.Namespace) -> EngineSettings:
    model = args.model
    if not model:
        from server.default_model import DEFAULT_MODEL_NAME, ensure_default_model

        model, name = str(ensure_default_model()), DEFAULT_MODEL_NAME
    else:
        name = Path(model.rstrip("/")).name
    return EngineSettings(model, name, args.dtype, args.max_model_len, args.kv_cache_gib, args.max_num_seqs)


def add_arguments(parser: argparse.ArgumentParser) -> None:
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


async def run(args: argparse.Namespace) -> dict[str, Any]:
    points = [("concurrency", float(c)) for c in args.concurrency.split(",") if c.strip()]
    points += [("rate", float(r)) for r in args.rates.split(",") if r.strip()]
    if not points or any(value <= 0 for _, value in points) or args.requests < 1:
        raise SystemExit(
            "phasescope bench: give at least one positive --concurrency or --rates point and --requests ≥ 1"
        )
    args.output_dir.mkdir(parents=True, exist_ok=True)
    settings = default_settings(args)
    results: list[dict[str, Any]] = []
    # One engine at a time: on a small machine two engines would measure each other.
    if args.compare:
        llm, in_process = start_in_process(settings)
        try:
            await sweep(in_process, points, args, results)
        finally:
            llm.shutdown()
        managed, openai = start_openai(settings, args.output_dir)
        try:
            await sweep(openai, points, args, results)
        finally:
            await openai.close()
            managed.stop()
    if args.address:
        await sweep(PhasescopeTarget(args.address, args.metrics_url, None), points, args, results)
    else:
        managed, ours = start_phasescope(settings, args.output_dir / "phasescope.log")
        try:
            await sweep(ours, points, args, results)
        finally:
            managed.stop()
    return {"settings": asdict(settings), "formulas": FORMULAS, "points": results, "ratios": ratios(results)}


def main(args: argparse.Namespace) -> int:
    report = asyncio.run(run(args))
    path = args.output_dir / "bench.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    plots = plot(report["points"], args.output_dir)
    print("\n" + "\n".join(f"  {value}" for value in FORMULAS.values()))
    columns = ("target", "load", "value", "output_throughput", "request_throughput", "median_ttft_ms", "p99_ttft_ms",
               "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "median_e2el_ms", "errors")  # fmt: skip
    print("| " + " | ".join(columns) + " | front-end CPU s/1k tok |")
    print("|" + "---|" * (len(columns) + 1))
    for point in report["points"]:
        cells = [f"{point[c]:.2f}" if isinstance(point[c], float) else str(point[c]) for c in columns]
        cpu = point.get("frontend_cpu_seconds_per_1k_tokens")
        print("| " + " | ".join(cells) + f" | {cpu:.3f} |" if cpu is not None else "| " + " | ".join(cells) + " | — |")
    for row in report["ratios"]:
        print("ratios " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
    print(f"results: {path}; plots: {', '.join(str(p) for p in plots)}", file=sys.stderr)
    return 0
