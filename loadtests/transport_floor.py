"""The streaming transports alone: server CPU of grpc.aio against uvicorn's SSE, side by side.

`--transports grpc.aio,grpc.sync,sse` adds grpc's thread-per-stream server (`grpc.server`
with a thread pool) to the comparison.

phasescope streams over grpc.aio; vLLM's OpenAI server streams server-sent
events from uvicorn. This takes the engine out of the comparison: each server
here streams a fixed small payload to N concurrent streams, one message per
stream per "step" of a shared ticker (as an engine step feeds every running
stream at once), and the harness reads the server process's CPU seconds over
the streaming window. Both servers run in their own process, one at a time,
on loopback, with the same step rate, stream counts and duration.

    .venv/bin/python -m loadtests.transport_floor --streams 1,4,16 --rate 15 --seconds 10

prints CPU ms per second and µs per message for each transport and point,
and grpc.aio ÷ SSE; the raw figures go to --output (JSON, gzipped if it ends in .gz), each
server's log beside it (`NAME.<transport>.log` for `NAME.json.gz`).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import http.client
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import psutil

from phasescope.bench.harness import ManagedProcess, free_port, listening, stop_on_sigterm, write_results

TRANSPORTS = ("grpc.aio", "grpc.sync", "sse")
PAYLOAD = b'{"text": " token", "token_ids": [1234]}'
METHOD = "/floor.Floor/Stream"


class Ticker:
    """One shared step clock: every waiting stream wakes on the same tick."""

    def __init__(self, rate: float) -> None:
        self._period = 1.0 / rate
        self._tick = asyncio.Event()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._period)
            tick, self._tick = self._tick, asyncio.Event()
            tick.set()

    async def steps(self, seconds: float) -> AsyncIterator[None]:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            await self._tick.wait()
            yield None


async def serve_grpc(port: int, rate: float, seconds: float) -> None:
    ticker = Ticker(rate)
    asyncio.get_running_loop().create_task(ticker.run())

    async def stream(request: bytes, context: Any) -> AsyncIterator[bytes]:
        async for _ in ticker.steps(seconds):
            yield PAYLOAD

    server = grpc.aio.server()
    handler = grpc.method_handlers_generic_handler(
        "floor.Floor",
        {"Stream": grpc.unary_stream_rpc_method_handler(stream)},
    )
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def serve_grpc_sync(port: int, rate: float, seconds: float, streams: int) -> None:
    """grpc's thread-per-stream server: each stream's handler thread waits for the shared tick."""
    tick = threading.Condition()
    period = 1.0 / rate

    def ticker() -> None:
        while True:
            time.sleep(period)
            with tick:
                tick.notify_all()

    def stream(request: bytes, context: Any) -> Any:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            with tick:
                tick.wait()
            yield PAYLOAD

    threading.Thread(target=ticker, daemon=True).start()
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=streams + 4))
    handler = grpc.method_handlers_generic_handler(
        "floor.Floor",
        {"Stream": grpc.unary_stream_rpc_method_handler(stream)},
    )
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


def serve_sse(port: int, rate: float, seconds: float) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    ticker: Ticker | None = None

    async def events() -> AsyncIterator[bytes]:
        assert ticker is not None
        async for _ in ticker.steps(seconds):
            yield b"data: " + PAYLOAD + b"\n\n"

    async def stream(request: Any) -> StreamingResponse:
        nonlocal ticker
        if ticker is None:
            ticker = Ticker(rate)
            asyncio.get_running_loop().create_task(ticker.run())
        return StreamingResponse(events(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/stream", stream, methods=["POST"])])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def read_grpc(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call: grpc.UnaryStreamMultiCallable[bytes, bytes] = channel.unary_stream(METHOD)
        return sum(1 for _ in call(b"", timeout=300))


def read_sse(port: int) -> int:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    connection.request("POST", "/stream")
    response = connection.getresponse()
    count = 0
    for line in response:
        if line.startswith(b"data: "):
            count += 1
    connection.close()
    return count


def measure(transport: str, streams: int, rate: float, seconds: float, log: Path) -> dict[str, Any]:
    port = free_port()
    with ManagedProcess(
        [sys.executable, "-m", "loadtests.transport_floor", "--serve", transport, "--port", str(port),
         "--rate", str(rate), "--seconds", str(seconds), "--streams", str(streams)],
        log,
    ) as server:  # fmt: skip
        server.wait_until(lambda: listening(port), f"the {transport} server", timeout=30)
        time.sleep(1.0)  # let start-up work finish before the window opens
        process = psutil.Process(server.process.pid)
        reader = read_sse if transport == "sse" else read_grpc
        counts: list[int] = []
        threads = [threading.Thread(target=lambda: counts.append(reader(port))) for _ in range(streams)]
        before = process.cpu_times()
        started = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(seconds + 60)
        elapsed = time.monotonic() - started
        after = process.cpu_times()
    cpu = (after.user - before.user) + (after.system - before.system)
    messages = sum(counts)
    return {
        "transport": transport,
        "streams": streams,
        "rate_per_stream": rate,
        "seconds": elapsed,
        "messages": messages,
        "server_cpu_seconds": cpu,
        "server_cpu_ms_per_second": 1000 * cpu / elapsed,
        "server_cpu_us_per_message": 1e6 * cpu / messages if messages else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--streams", default="1,4,16", help="concurrent streams per point")
    parser.add_argument("--rate", type=float, default=15.0, help="steps per second (one message per stream per step)")
    parser.add_argument("--seconds", type=float, default=10.0, help="streaming time per point")
    parser.add_argument(
        "--transports", default="grpc.aio,sse", help="servers to measure, in order: grpc.aio, grpc.sync, sse"
    )
    parser.add_argument("--output", type=Path, default=Path("loadtests/results/transport_floor.json.gz"))
    parser.add_argument("--serve", choices=TRANSPORTS, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve == "grpc.aio":
        asyncio.run(serve_grpc(args.port, args.rate, args.seconds))
        return 0
    if args.serve == "grpc.sync":
        serve_grpc_sync(args.port, args.rate, args.seconds, int(args.streams))
        return 0
    if args.serve == "sse":
        serve_sse(args.port, args.rate, args.seconds)
        return 0
    transports = [name.strip() for name in args.transports.split(",")]
    unknown = sorted(set(transports) - set(TRANSPORTS))
    if unknown:
        parser.error(f"--transports: unknown {', '.join(unknown)}; choose from {', '.join(TRANSPORTS)}")
    stop_on_sigterm()  # the servers it starts are stopped on SIGTERM too
    points = [int(value) for value in args.streams.split(",")]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    # x.json.gz and x.json both log to x.<transport>.log: with_suffix alone would keep the .json of x.json.gz.
    logs = args.output.with_suffix("") if args.output.suffix == ".gz" else args.output
    results = []
    print(f"{'transport':<9} {'streams':>7} {'msgs/s':>8} {'CPU ms/s':>9} {'µs/msg':>8}")
    for streams in points:
        for transport in transports:
            row = measure(transport, streams, args.rate, args.seconds, logs.with_suffix(f".{transport}.log"))
            results.append(row)
            print(
                f"{transport:<9} {streams:>7} {row['messages'] / row['seconds']:>8.1f} "
                f"{row['server_cpu_ms_per_second']:>9.1f} {row['server_cpu_us_per_message'] or 0:>8.0f}"
            )
    cpu = {(row["transport"], row["streams"]): row["server_cpu_seconds"] for row in results}
    if "sse" in transports:
        for other in (t for t in transports if t != "sse"):
            print(f"\n{other} ÷ SSE, server CPU at the same point:")
            for streams in points:
                print(f"  {streams:>3} streams: {cpu[other, streams] / cpu['sse', streams]:.2f}")
    write_results(args.output, {"rate": args.rate, "points": results}, indent=2)
    print(f"\nraw results: {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
