"""What phasescope's telemetry hub costs for the engine's reports, on its own: an engine core's reports captured
behind smg's bare Rust request path, then replayed through the hub's aggregation and series on one thread.

    .venv/bin/python -m loadtests.hub_cost capture --output /tmp/reports.bin --seconds 10 --concurrency 64
    .venv/bin/python -m loadtests.hub_cost replay /tmp/reports.bin --repeats 5 --profile 25

`capture` starts the bare Rust worker (`phasescope.bench.rust_worker`) over the tiny random-weight model with
phasescope's scheduler in its engine core (`--scheduler-cls`, `--enable-mfu-metrics`) publishing to a socket of
this process, drives `--concurrency` streams of 30-token prompts × 128 tokens (token ids, `ignore_eos`) for
`--seconds` after as long a warm-up, stops the worker, and writes every message its core published (a 4-byte
little-endian length, then the message as the hub receives it).

`replay` wires a hub's telemetry (`phasescope.serve.hub.HubTelemetry`: the step aggregator, the step and request
series, the live latencies) from the captured facts, judged against fixed peaks (no probe), and hands it each
message's reports as the hub's thread does, on this thread. It prints the CPU the whole replay took (the median
of `--repeats`, after one untimed), per report and per 1,000 output tokens the reports carried, and with
`--profile N` cProfile's N costliest functions by their own time. The replay runs alone on an idle core: beside
a busy engine core and request path the same work costs the hub's thread more (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import pstats
import random
import statistics
import struct
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import zmq

from phasescope.bench.harness import ManagedProcess, free_port, health_status
from phasescope.environment import TELEMETRY_ENDPOINT
from phasescope.telemetry.step.records import StepReport
from phasescope.telemetry.step.transport import ReportBatch, decode

LENGTH = struct.Struct("<I")
PROMPT_TOKENS = 30
OUTPUT_TOKENS = 128


def read_messages(path: Path) -> list[bytes]:
    data = path.read_bytes()
    messages, offset = [], 0
    while offset < len(data):
        (size,) = LENGTH.unpack_from(data, offset)
        offset += LENGTH.size
        messages.append(data[offset : offset + size])
        offset += size
    return messages


def write_messages(path: Path, messages: list[bytes]) -> None:
    with path.open("wb") as out:
        for message in messages:
            out.write(LENGTH.pack(len(message)))
            out.write(message)


async def drive(address: str, seconds: float, concurrency: int) -> int:
    """`concurrency` closed-loop streams for `seconds`; the output tokens they received."""
    import grpc
    from smg_grpc_proto.generated import vllm_engine_pb2 as pb
    from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_grpc

    received = 0
    end = time.monotonic() + seconds
    async with grpc.aio.insecure_channel(address) as channel:
        stub: Any = vllm_grpc.VllmEngineStub(channel)  # type: ignore[no-untyped-call]  # no stubs

        async def stream(seed: int) -> None:
            nonlocal received
            rng = random.Random(seed)
            while time.monotonic() < end:
                request = pb.GenerateRequest(
                    request_id=f"hub-cost-{uuid.uuid4().hex}",
                    tokenized=pb.TokenizedInput(input_ids=[rng.randrange(100, 1000) for _ in range(PROMPT_TOKENS)]),
                    sampling_params=pb.SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True),
                    stream=True,
                )
                async for response in stub.Generate(request, timeout=600):
                    if response.HasField("chunk"):
                        received += len(response.chunk.token_ids)

        await asyncio.gather(*(stream(seed) for seed in range(concurrency)))
    return received


def capture(output: Path, seconds: float, concurrency: int) -> None:
    from phasescope.bench.tiny_model import TINY_MODEL_NAME, ensure_tiny_model
    from phasescope.engine.vllm import TELEMETRY_SCHEDULER

    messages: list[bytes] = []
    closing = threading.Event()
    context = zmq.Context()
    socket = context.socket(zmq.PULL)
    folder = Path(tempfile.mkdtemp(prefix="hub-cost-"))
    socket.bind(f"ipc://{folder / 'steps'}")

    def receive() -> None:
        while not closing.is_set() or socket.poll(0):
            if socket.poll(200):
                messages.append(socket.recv())

    receiver = threading.Thread(target=receive, name="hub-cost-capture")
    receiver.start()
    port = free_port()
    events = f'{{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:{free_port()}"}}'
    command = [
        sys.executable, "-m", "phasescope.bench.rust_worker", "--model", str(ensure_tiny_model()),
        "--served-model-name", TINY_MODEL_NAME, "--dtype", "float32", "--enforce-eager", "--max-model-len", "1024",
        "--max-num-seqs", "128", "--kv-cache-memory-bytes", str(2 * 2**30), "--host", "127.0.0.1", "--port",
        str(port), "--kv-events-config", events, "--scheduler-cls", TELEMETRY_SCHEDULER, "--enable-mfu-metrics",
    ]  # fmt: skip
    env = {TELEMETRY_ENDPOINT: f"ipc://{folder / 'steps'}", "VLLM_LOGGING_LEVEL": "WARNING"}
    worker = ManagedProcess(command, folder / "worker.log", env=env)
    address = f"127.0.0.1:{port}"
    try:
        print("starting the bare Rust worker (the tiny model, phasescope's scheduler) ...", flush=True)
        worker.wait_until(lambda: health_status(address, "") == "SERVING", "the Rust worker")
        print(f"warming up for {seconds:.0f} s, then {seconds:.0f} s of {concurrency} streams ...", flush=True)
        asyncio.run(drive(address, seconds, concurrency))
        received = asyncio.run(drive(address, seconds, concurrency))
        print(f"{received} output tokens received in the measured {seconds:.0f} s", flush=True)
    finally:
        worker.stop()
        closing.set()
        receiver.join()
        socket.close(linger=0)
        context.term()
    write_messages(output, messages)
    print(f"{len(messages)} messages written to {output} (the worker's log: {worker.log_path})")


def replay(path: Path, repeats: int, profile: int) -> None:
    from prometheus_client import CollectorRegistry

    from phasescope.serve.config import Settings
    from phasescope.serve.hub import HubTelemetry
    from phasescope.telemetry.pipeline import TelemetryPipeline
    from phasescope.telemetry.step.records import StepForwarder

    messages = read_messages(path)
    batches: list[ReportBatch] = [decode(message) for message in messages]
    facts = next((batch.facts for batch in batches if batch.facts is not None), None)
    if facts is None:
        raise SystemExit(f"{path}: no message carries the engine core's facts (capture from the worker's start)")
    reports = sum(len(batch.reports) for batch in batches)
    tokens = sum(r.iteration.emitted_tokens for batch in batches for r in batch.reports if r.iteration is not None)
    finished = sum(len(r.finished) for batch in batches for r in batch.reports)

    async def wired() -> HubTelemetry:
        # Fixed peaks: what they are does not change the work, and no probe runs.
        settings = Settings(peak_memory_bandwidth=1e11, peak_flops=1e12)
        telemetry = HubTelemetry(settings, CollectorRegistry(), StepForwarder(), TelemetryPipeline())
        telemetry.registry.register(telemetry.pipeline.scrape_hook())
        telemetry.engine_facts(facts)
        assert telemetry._attaching is not None
        await telemetry._attaching
        if not telemetry.ready.is_set():
            raise SystemExit("the hub's series were not wired (see the log above)")
        return telemetry

    telemetry = asyncio.run(wired())

    def run() -> None:
        # As the hub's thread does (phasescope.telemetry.step.transport.StepHub): each message decoded, its reports
        # and its publisher's health handed on; what the pipeline still holds handed on at the end, as a scrape would.
        for message in messages:
            batch = decode(message)
            handed = list(batch.reports)
            handed.append(StepReport(publisher=batch.health))
            telemetry.steps.report_batch(handed)
        telemetry.pipeline.hand_on()

    run()
    took = []
    for _ in range(repeats):
        gc.collect()  # each replay starts from the same heap: a full collection inside one would swamp its figure
        started = time.thread_time()
        run()
        took.append(time.thread_time() - started)
    median = statistics.median(took)
    print(
        f"{len(messages)} messages, {reports} reports, {finished} finished requests, {tokens} output tokens: "
        f"{median * 1e3:.1f} ms of CPU [{min(took) * 1e3:.1f}–{max(took) * 1e3:.1f}] over {repeats} replays, "
        f"{median / reports * 1e6:.1f} µs per report, {median / tokens * 1e3 * 1e3:.3f} ms per 1,000 output tokens"
    )
    if profile:
        profiler = cProfile.Profile()
        profiler.enable()
        run()
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(profile)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtests.hub_cost", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    taking = commands.add_parser("capture", help="an engine core's reports behind the bare Rust worker, to a file")
    taking.add_argument("--output", type=Path, required=True)
    taking.add_argument("--seconds", type=float, default=10.0, help="of measured load (and as long a warm-up)")
    taking.add_argument("--concurrency", type=int, default=64)
    replaying = commands.add_parser("replay", help="a capture through the hub's aggregation and series")
    replaying.add_argument("capture", type=Path)
    replaying.add_argument("--repeats", type=int, default=5)
    replaying.add_argument("--profile", type=int, default=0, help="print cProfile's N costliest functions")
    args = parser.parse_args(argv)
    if args.command == "capture":
        capture(args.output, args.seconds, args.concurrency)
    else:
        replay(args.capture, args.repeats, args.profile)


if __name__ == "__main__":
    main()
