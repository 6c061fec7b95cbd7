"""Where a burst waits: from a client sending a request to the server's handler starting, request by request.

grpc.aio's server keeps one `grpc_server_request_call` outstanding: it accepts the next RPC only
once the event loop has run the previous acceptance's callback. N requests arriving together
therefore enter their handlers one loop turn apart, and a loop turn lasts as long as the work
queued in it (every running stream's chunks). This sends `--burst` streams at once, `--waves`
times, and prints each wave's waits before the handler started, sorted: a ramp from zero to the
maximum is sequential acceptance, the same requests all waiting alike would be a queue in front.

    .venv/bin/python -m loadtests.burst_accept --bare --burst 128         # a bare grpc.aio server
    .venv/bin/python -m loadtests.burst_accept --tiny-model --burst 128   # phasescope on the tiny model

Against phasescope a request's wait is the client's time to its first token minus the server's
own `client_time_to_first_token_seconds` (handler entry to first chunk written, from the final
chunk's timings), so it also holds the first chunk's delivery. Against the bare server (its own
process; it streams 64 messages per call on a shared 30 ms tick, as an engine step feeds every
stream) each stream's first message carries its handler's entry time (same machine, wall clock).
Raw waits go to --output (JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

from loadtests.transport_floor import Ticker
from phasescope.bench.harness import (
    ManagedProcess,
    PhasescopeProcess,
    free_port,
    listening,
    stop_on_sigterm,
    write_results,
)

METHOD = "/burst.Burst/Stream"
MESSAGES = 64
TICK_SECONDS = 0.03


async def serve_bare(port: int) -> None:
    ticker = Ticker(1 / TICK_SECONDS)

    async def stream(request: bytes, context: Any) -> AsyncIterator[bytes]:
        yield struct.pack("d", time.time())  # the handler's entry: nothing before it is the handler's
        sent = 1
        async for _ in ticker.steps(float("inf")):
            if sent == MESSAGES:
                return
            yield b"token"
            sent += 1

    loop_task = asyncio.get_running_loop().create_task(ticker.run())
    server = grpc.aio.server()
    handler = grpc.method_handlers_generic_handler(
        "burst.Burst", {"Stream": grpc.unary_stream_rpc_method_handler(stream)}
    )
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    try:
        await server.wait_for_termination()
    finally:
        loop_task.cancel()


async def bare_wait(channel: grpc.aio.Channel, index: int) -> float:
    stream: Any = channel.unary_stream(METHOD)
    sent = time.time()
    call = stream(b"")
    entered = None
    async for message in call:
        if entered is None:
            entered = struct.unpack("d", message)[0]
    assert entered is not None
    return float(entered - sent)


async def phasescope_wait(channel: grpc.aio.Channel, index: int) -> float:
    from phasescope.client.client import build_request
    from phasescope.v1 import inference_pb2_grpc as pb_grpc

    stub = pb_grpc.InferenceStub(channel)
    request = build_request(prompt=f"Story {index}: the sea and the sky.", max_tokens=MESSAGES, ignore_eos=True)
    sent = time.perf_counter()
    first = None
    server_ttft = 0.0
    async for chunk in stub.GenerateStream(request, timeout=600):
        if first is None and chunk.token_ids:
            first = time.perf_counter()
        if chunk.HasField("timings"):
            server_ttft = chunk.timings.client_time_to_first_token_seconds
    assert first is not None
    return first - sent - server_ttft


async def waves(
    address: str, wait: Callable[[grpc.aio.Channel, int], Awaitable[float]], burst: int, count: int
) -> list[list[float]]:
    results = []
    async with grpc.aio.insecure_channel(address) as channel:
        await asyncio.gather(*(wait(channel, i) for i in range(4)))  # warm: the connection and the handlers
        for wave in range(count):
            waits = sorted(await asyncio.gather(*(wait(channel, i) for i in range(burst))))
            results.append(waits)
            step = max(1, burst // 16)
            print(
                f"wave {wave + 1}: wait before the handler p50 {statistics.median(waits) * 1e3:7.1f} ms, "
                f"max {waits[-1] * 1e3:7.1f} ms; sorted, every {step}th: {[round(w * 1e3) for w in waits[::step]]}",
                flush=True,
            )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--bare", action="store_true", help="a bare grpc.aio server in its own process")
    target.add_argument("--tiny-model", action="store_true", help="phasescope serving phasescope.bench.tiny_model")
    parser.add_argument("--burst", type=int, default=128, help="requests sent at once")
    parser.add_argument("--waves", type=int, default=3)
    parser.add_argument("--output", type=Path, help="raw waits (seconds) as JSON, gzipped if it ends in .gz")
    parser.add_argument("--server-log", type=Path, help="keep the server's log here (else it is deleted)")
    parser.add_argument("--serve-bare", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_bare:
        asyncio.run(serve_bare(args.serve_bare))
        return 0
    stop_on_sigterm()
    with tempfile.TemporaryDirectory() as scratch:
        log = args.server_log or Path(scratch) / "server.log"
        server: ManagedProcess
        port = 0
        if args.bare:
            port = free_port()
            address = f"127.0.0.1:{port}"
            server = ManagedProcess(
                [sys.executable, "-m", "loadtests.burst_accept", "--bare", "--serve-bare", str(port)], log
            )
            wait: Callable[[grpc.aio.Channel, int], Awaitable[float]] = bare_wait
        else:
            from phasescope.bench.tiny_model import ensure_tiny_model

            model = ensure_tiny_model()
            phasescope = PhasescopeProcess(
                ["--model", str(model), "--enforce-eager", "--max-concurrent-requests", str(max(args.burst, 4))], log
            )
            server, address, wait = phasescope, phasescope.address, phasescope_wait
        with server:
            if isinstance(server, PhasescopeProcess):
                server.wait_serving()
            else:
                server.wait_until(lambda: listening(port), "the bare grpc.aio server", timeout=30)
            started = time.monotonic()
            results = asyncio.run(waves(address, wait, args.burst, args.waves))
    if args.output:
        body = {
            "target": "bare grpc.aio" if args.bare else "phasescope (tiny model)",
            "burst": args.burst,
            "messages_per_stream": MESSAGES,
            "seconds": time.monotonic() - started,
            "waits_seconds": results,
        }
        write_results(args.output, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
