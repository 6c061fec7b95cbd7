"""What watching costs: serving throughput with 0 and with N WatchTelemetry watchers, side by side.

One server (the embedded default model) serves the same fixed load in rounds, with no
watcher and with N watchers at the given interval, alternating A B A B … so that
machine drift hits both alike. Each round sends `--concurrency` streams of
`--max-tokens` tokens at once; tokens/s is output tokens ÷ the round's wall time, and
the server process's CPU seconds per round are read beside it. The watchers read every
snapshot (as `phasescope top` does).

    .venv/bin/python -m loadtests.watch_cost --watchers 4 --interval 1 --rounds 6

prints each round and the medians, and (with watchers) ÷ (without) for tokens/s and
server CPU per token; the raw rounds go to --output (JSON). Loopback only, bounded.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil

from phasescope.bench.harness import PhasescopeProcess, stop_on_sigterm, write_results
from phasescope.client.client import Client, build_request
from phasescope.v1 import inference_pb2 as pb


class Watchers:
    """N watchers reading every snapshot until stopped."""

    def __init__(self, address: str, count: int, interval: float) -> None:
        self._clients = [Client(address) for _ in range(count)]
        self._calls: list[Any] = []
        self.snapshots = 0
        self._lock = threading.Lock()
        self._threads = []
        for client in self._clients:
            call = client.watch_telemetry(pb.WatchTelemetryRequest(interval_seconds=interval))
            self._calls.append(call)
            thread = threading.Thread(target=self._read, args=(call,), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _read(self, call: Any) -> None:
        try:
            for _ in call:
                with self._lock:
                    self.snapshots += 1
        except Exception:  # cancelled at stop
            pass

    def stop(self) -> None:
        for call in self._calls:
            call.cancel()
        for thread in self._threads:
            thread.join(10)
        for client in self._clients:
            client.close()


def one_round(address: str, concurrency: int, max_tokens: int, process: psutil.Process) -> dict[str, float]:
    def stream(index: int) -> int:
        with Client(address) as client:
            request = build_request(prompt=f"Story {index}:", max_tokens=max_tokens, ignore_eos=True)
            return sum(len(chunk.token_ids) for chunk in client.generate_stream(request))

    cpu_before = process.cpu_times()
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(stream, range(concurrency)))
    seconds = time.perf_counter() - started
    cpu_after = process.cpu_times()
    cpu = (cpu_after.user - cpu_before.user) + (cpu_after.system - cpu_before.system)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds, "server_cpu_seconds": cpu}


def main(argv: list[str] | None = None) -> int:
    stop_on_sigterm()  # the servers and engines it starts are stopped on SIGTERM too
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--watchers", type=int, default=4)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=6, help="rounds per arm (alternating)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--output", type=Path, help="raw rounds as JSON, gzipped if it ends in .gz")
    args = parser.parse_args(argv)
    log = Path(tempfile.mkdtemp(prefix="watch-cost-")) / "server.log"
    server = PhasescopeProcess(["--enforce-eager"], log)
    with server:
        server.wait_serving()
        process = psutil.Process(server.process.pid)
        one_round(server.address, args.concurrency, 8, process)  # warm-up
        rounds: list[dict[str, Any]] = []
        for index in range(2 * args.rounds):
            watched = index % 2 == 1
            server.wait_engine_idle(60)
            watchers = Watchers(server.address, args.watchers, args.interval) if watched else None
            try:
                result = one_round(server.address, args.concurrency, args.max_tokens, process)
            finally:
                if watchers is not None:
                    watchers.stop()
            result["watchers"] = args.watchers if watched else 0
            result["snapshots_read"] = watchers.snapshots if watchers is not None else 0
            rounds.append(result)
            print(
                f"round {index + 1:>2}: {result['watchers']} watchers  {result['tokens_per_second']:8.2f} tok/s  "
                f"server CPU {result['server_cpu_seconds']:.2f} s  snapshots read {result['snapshots_read']}",
                flush=True,
            )

    def median(watchers: int, key: str) -> float:
        return float(statistics.median(float(r[key]) for r in rounds if r["watchers"] == watchers))

    def cpu_per_token(watchers: int) -> float:
        return float(
            statistics.median(
                float(r["server_cpu_seconds"]) / float(r["tokens"]) for r in rounds if r["watchers"] == watchers
            )
        )

    base, watched_rate = median(0, "tokens_per_second"), median(args.watchers, "tokens_per_second")
    summary = {
        "tokens_per_second_without": base,
        "tokens_per_second_with": watched_rate,
        "throughput_ratio": watched_rate / base,
        "server_cpu_per_token_ratio": cpu_per_token(args.watchers) / cpu_per_token(0),
    }
    print(
        f"median tokens/s: {base:.2f} without, {watched_rate:.2f} with {args.watchers} watchers at "
        f"{args.interval:g} s: ratio {summary['throughput_ratio']:.3f}; server CPU per token ratio "
        f"{summary['server_cpu_per_token_ratio']:.3f}"
    )
    if args.output:
        write_results(args.output, {"arguments": vars(args) | {"output": str(args.output)}, "rounds": rounds,
                                    "summary": summary}, indent=2)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
