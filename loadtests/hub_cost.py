"""What phasescope's telemetry hub costs for the engine's reports, on its own: an engine core's reports captured
behind smg's bare Rust request path, then replayed through the hub's aggregation and series on one thread.

    .venv/bin/python -m loadtests.hub_cost capture --output /tmp/reports.bin --requests 640 --concurrency 64
    .venv/bin/python -m loadtests.hub_cost replay /tmp/reports.bin --repeats 9 --profile 25

`capture` starts the bench's bare Rust worker (`phasescope bench`'s `vllm-rust` on its tiny-model settings) with
phasescope's scheduler in its engine core (`--scheduler-cls`, `--enable-mfu-metrics`) publishing to a socket of
this process, runs the bench's closed loop over it (`--requests` of 30 prompt tokens and 128 output tokens at
`--concurrency`, after as many to warm up), stops the worker, and writes every message its core published (a
4-byte little-endian length, then the message as the hub receives it).

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
import statistics
import struct
import tempfile
import threading
import time
from pathlib import Path

import zmq

from phasescope.environment import export_telemetry_endpoint
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


def capture(output: Path, requests: int, concurrency: int) -> None:
    from phasescope.bench.launch import EngineSettings, start_vllm_rust
    from phasescope.bench.loop import run_point
    from phasescope.bench.tiny_model import TINY_MODEL_NAME, ensure_tiny_model
    from phasescope.bench.workload import LengthDistribution, RequestRecord, WorkloadSpec, workload
    from phasescope.engine.vllm import TELEMETRY_SCHEDULER

    messages: list[bytes] = []
    closing = threading.Event()
    context = zmq.Context()
    socket = context.socket(zmq.PULL)
    folder = Path(tempfile.mkdtemp(prefix="hub-cost-"))
    endpoint = f"ipc://{folder / 'steps'}"
    socket.bind(endpoint)

    def receive() -> None:
        while not closing.is_set() or socket.poll(0):
            if socket.poll(200):
                messages.append(socket.recv())

    receiver = threading.Thread(target=receive, name="hub-cost-capture")
    receiver.start()
    export_telemetry_endpoint(endpoint)  # the worker's engine core inherits it
    # The bench's engine settings for the tiny model (`phasescope bench --tiny-model`), its workload and closed loop.
    settings = EngineSettings(str(ensure_tiny_model()), TINY_MODEL_NAME, "float32", 1024, 2.0, 128)
    spec = WorkloadSpec(LengthDistribution("fixed", PROMPT_TOKENS), LengthDistribution("fixed", OUTPUT_TOKENS))

    async def load() -> list[RequestRecord]:
        """The worker started (its target's channel on this loop), a warm-up and the run; both runs' records."""
        print("starting the bare Rust worker (the tiny model, phasescope's scheduler) ...", flush=True)
        worker, target = start_vllm_rust(
            settings, folder, extra_args=("--scheduler-cls", TELEMETRY_SCHEDULER, "--enable-mfu-metrics")
        )
        records: list[RequestRecord] = []
        try:
            for seed in (1, 2):
                run, _ = await run_point(
                    target, workload(spec, seed, requests), concurrency=concurrency, rate=None, seed=seed,
                    progress=lambda: None,
                )  # fmt: skip
                records.extend(run)
            return records
        finally:
            await target.close()
            worker.stop()

    try:
        records = asyncio.run(load())
    finally:
        closing.set()
        receiver.join()
        socket.close(linger=0)
        context.term()
    failed = [record.error for record in records if record.error]
    if failed:
        raise SystemExit(f"{len(failed)} of {len(records)} requests failed, the first: {failed[0]}")
    print(f"{sum(record.output_tokens for record in records)} output tokens, half of them the warm-up's")
    write_messages(output, messages)
    print(f"{len(messages)} messages written to {output} (the worker's log is in {folder})")


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
    if not tokens:
        raise SystemExit(f"{path}: its reports carry no output token (did the capture's requests fail?)")
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
    taking.add_argument("--requests", type=int, default=640, help="measured (and as many to warm up first)")
    taking.add_argument("--concurrency", type=int, default=64)
    replaying = commands.add_parser("replay", help="a capture through the hub's aggregation and series")
    replaying.add_argument("capture", type=Path)
    replaying.add_argument("--repeats", type=int, default=5)
    replaying.add_argument("--profile", type=int, default=0, help="print cProfile's N costliest functions")
    args = parser.parse_args(argv)
    if args.command == "capture":
        capture(args.output, args.requests, args.concurrency)
    else:
        replay(args.capture, args.repeats, args.profile)


if __name__ == "__main__":
    main()
