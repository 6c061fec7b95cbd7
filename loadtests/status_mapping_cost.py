"""What the exception-to-status mapping costs each streamed message, served four ways by a bare grpc.aio server:

- unwrapped: the handler as it is, no mapping;
- inline: the handler maps its own errors (an async context manager around its body, as GenerateStream and the
  engine protocol's Generate did with `StatusOnError` before 51cd8a4);
- generator: an interceptor's wrapper that is an async generator yielding each message on (before 353d7e6);
- interceptor: `phasescope.serve.interceptors.ExceptionToStatusInterceptor` as it is.

The handler yields `--messages` messages of 24 bytes. `cpu` reads the server's CPU (user + system, the whole
process and its event-loop thread) around each call, the ways alternating call by call, and prints each way's
median and its ratio to `inline` in the same round; `instructions` runs the server under callgrind
(`valgrind --tool=callgrind --separate-threads=yes`), dumps its counters around each call and prints
instructions per message, which the machine's other work does not move:

    .venv/bin/python -m loadtests.status_mapping_cost cpu --messages 100000 --rounds 20
    .venv/bin/python -m loadtests.status_mapping_cost instructions --messages 3000 --repeats 3

The server runs in a child process (pinned to CPU 1 for `cpu`, the client to CPU 0 when it is started under
`taskset -c 0`), stopped when the measurement ends. Findings: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncGenerator, Callable
from types import TracebackType
from typing import Any

import grpc

from phasescope.serve.interceptors import ExceptionToStatusInterceptor

RAW = "bench.Raw"
MAPPED = "bench.Mapped"
WAYS = {"unwrapped": RAW, "inline": RAW, "generator": RAW, "interceptor": MAPPED}
MESSAGE = b"x" * 24
_Context = grpc.aio.ServicerContext[Any, Any]
_Stream = Callable[[bytes, _Context], AsyncGenerator[bytes, None]]
_Handlers = dict[str, "grpc.RpcMethodHandler[Any, Any]"]  # the stubs' generic, not subscriptable at run time


async def _abort(context: _Context, exc: Exception) -> None:
    await context.abort(grpc.StatusCode.INTERNAL, type(exc).__name__)


class _Inline:
    """The handler's own mapping, as StatusOnError was."""

    __slots__ = ("_context",)

    def __init__(self, context: _Context) -> None:
        self._context = context

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> bool:
        if not isinstance(exc, Exception) or isinstance(exc, grpc.aio.AbortError):
            return False
        await _abort(self._context, exc)
        return True


def _generator(stream: _Stream) -> _Stream:
    """The interceptor's stream wrapper as it was: each message crosses its generator."""

    async def mapped(request: bytes, context: _Context) -> AsyncGenerator[bytes, None]:
        responses = stream(request, context)
        try:
            async for response in responses:
                yield response
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort(context, exc)
        finally:
            await responses.aclose()

    return mapped


async def _unwrapped(request: bytes, context: _Context) -> AsyncGenerator[bytes, None]:
    for _ in range(int(request)):
        yield MESSAGE


async def _inline(request: bytes, context: _Context) -> AsyncGenerator[bytes, None]:
    async with _Inline(context):
        for _ in range(int(request)):
            yield MESSAGE


async def serve() -> None:
    server = grpc.aio.server(interceptors=[ExceptionToStatusInterceptor((MAPPED,))])
    raw: _Handlers = {
        "unwrapped": grpc.unary_stream_rpc_method_handler(_unwrapped),
        "inline": grpc.unary_stream_rpc_method_handler(_inline),
        "generator": grpc.unary_stream_rpc_method_handler(_generator(_unwrapped)),
    }
    mapped: _Handlers = {"interceptor": grpc.unary_stream_rpc_method_handler(_unwrapped)}
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(RAW, raw), grpc.method_handlers_generic_handler(MAPPED, mapped))
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


def _cpu_seconds(stat: str) -> float:
    with open(stat) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _call(channel: grpc.aio.Channel, way: str, messages: int) -> None:
    method: grpc.aio.UnaryStreamMultiCallable[bytes, bytes] = channel.unary_stream(f"/{WAYS[way]}/{way}")
    received = 0
    async for _ in method(str(messages).encode()):
        received += 1
    assert received == messages, (way, received)


def _report(title: str, per_message: dict[str, list[float]]) -> None:
    print(title)
    print(f"{'way':<12} {'median':>9} {'min':>9} {'max':>9}   ratio to inline in the same round: median, mean ± 2 se")
    for way, values in per_message.items():
        ratios = [value / base - 1 for value, base in zip(values, per_message["inline"], strict=True)]
        se = statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else 0.0
        print(
            f"{way:<12} {statistics.median(values):9.2f} {min(values):9.2f} {max(values):9.2f}"
            f"   {100 * statistics.median(ratios):+5.1f} %  {100 * statistics.mean(ratios):+5.1f} % ± {200 * se:.1f} %"
        )


async def measure_cpu(port: int, pid: int, messages: int, rounds: int) -> None:
    ways = list(WAYS)
    process: dict[str, list[float]] = {way: [] for way in ways}
    loop_thread: dict[str, list[float]] = {way: [] for way in ways}
    stats = f"/proc/{pid}/stat", f"/proc/{pid}/task/{pid}/stat"
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        for way in ways:
            await _call(channel, way, 2000)  # warm-up
        for index in range(rounds):
            order = ways[index % len(ways) :] + ways[: index % len(ways)]
            for way in reversed(order) if index % 2 else order:
                before = [_cpu_seconds(stat) for stat in stats]
                await _call(channel, way, messages)
                after = [_cpu_seconds(stat) for stat in stats]
                process[way].append((after[0] - before[0]) / messages * 1e6)
                loop_thread[way].append((after[1] - before[1]) / messages * 1e6)
    _report(f"server process, CPU µs per message ({rounds} rounds of {messages} messages)", process)
    _report("its event-loop thread, CPU µs per message", loop_thread)


def _dump(pid: int, out: str) -> float:
    """Callgrind's counters of the event-loop thread since the last dump (the dump resets them)."""
    before = set(glob.glob(f"{out}/callgrind.out.{pid}*"))
    subprocess.run(["callgrind_control", "-d", str(pid)], check=True, capture_output=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        new = [path for path in set(glob.glob(f"{out}/callgrind.out.{pid}*")) - before if path.endswith("-01")]
        if new:
            time.sleep(0.5)  # written in full
            with open(new[0]) as f:
                for line in f:
                    if line.startswith(("summary:", "totals:")):
                        return float(line.split()[1])
        time.sleep(0.1)
    raise RuntimeError("callgrind wrote no dump")


async def measure_instructions(port: int, pid: int, out: str, messages: int, repeats: int) -> None:
    per_message: dict[str, list[float]] = {way: [] for way in WAYS}
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        for way in WAYS:
            await _call(channel, way, 200)  # warm-up
        for _ in range(repeats):
            for way in WAYS:
                _dump(pid, out)
                await _call(channel, way, messages)
                per_message[way].append(_dump(pid, out) / messages)
    _report(f"event-loop thread, instructions per message (callgrind; {repeats} calls of {messages})", per_message)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("cpu", "instructions", "serve"))
    parser.add_argument("--messages", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=20, help="cpu: rounds, each calling every way once")
    parser.add_argument("--repeats", type=int, default=3, help="instructions: calls of each way")
    args = parser.parse_args()
    if args.mode == "serve":
        asyncio.run(serve())
        return
    server = [sys.executable, "-m", "loadtests.status_mapping_cost", "serve"]
    with tempfile.TemporaryDirectory() as out:
        if args.mode == "cpu":
            command = ["taskset", "-c", "1", *server]
        else:
            command = [
                "valgrind",
                "--tool=callgrind",
                "--separate-threads=yes",
                f"--callgrind-out-file={out}/callgrind.out.%p",
                *server,
            ]
        child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            assert child.stdout is not None
            port = int(child.stdout.readline())
            if args.mode == "cpu":
                asyncio.run(measure_cpu(port, child.pid, args.messages or 100_000, args.rounds))
            else:
                asyncio.run(measure_instructions(port, child.pid, out, args.messages or 3000, args.repeats))
        finally:
            child.terminate()
            child.wait()


if __name__ == "__main__":
    main()
