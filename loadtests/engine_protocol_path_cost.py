"""What each server's own Python costs per streamed token over vLLM's engine protocol, side by side.

Both Generate handlers run in this process against one scripted `AsyncLLM` stand-in that yields
vLLM-shaped DELTA outputs (one token per step, its `RequestStateStats` advancing), with no gRPC
transport and no engine: what is left is the part the two servers do not share. Each response is
serialised as grpc.aio would. Streams run interleaved, `--concurrency` at once, as an engine's
output handler feeds them: every step wakes each stream once.

- phasescope: `VllmEngineServicer.Generate` over the real `RequestPath` with the server's own
  observers (Prometheus, recent latencies), admission, its own status mapping and
  `VllmEngine`'s step loop.
- vllm: `smg_grpc_servicer.vllm.servicer.VllmEngineServicer.Generate`, vLLM's own worker, its load
  tracker included.

Run from a checkout: `python loadtests/engine_protocol_path_cost.py --requests 2000 --max-tokens 128
--concurrency 64 --repeats 5`. It prints CPU µs per token and per request for each, repeat by repeat.
`--stages --requests 3000 --repeats 3` runs two-token requests one at a time instead and splits each one's
time: its intake (handler entered → the engine asked), its first output → first chunk, and its end.
Instruction counts do not drift with the machine as its times do: under `valgrind --tool=callgrind`,
`--requests N --max-tokens 1 --repeats 1 --only NAME` at two values of N, the difference of the totals ÷
the difference of N is one server's instructions per request.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import statistics
import time
from collections.abc import AsyncGenerator, Iterator
from types import SimpleNamespace
from typing import Any

from prometheus_client import CollectorRegistry
from smg_grpc_proto.generated import vllm_engine_pb2 as pb


class _Stats:
    """The fields of vLLM's `RequestStateStats` the servers read."""

    def __init__(self) -> None:
        now = time.monotonic()
        self.arrival_time = time.time()
        self.queued_ts = now
        self.scheduled_ts = now
        self.first_token_ts = 0.0
        self.last_token_ts = 0.0
        self.num_generation_tokens = 0
        self.first_token_latency = 0.0


class _Clock:
    """One engine step at a time: every waiting stream gets its next output per tick."""

    def __init__(self) -> None:
        self._tick = asyncio.Event()

    async def step(self) -> None:
        await self._tick.wait()

    async def run(self, until: asyncio.Future[Any]) -> None:
        while not until.done():
            self._tick.set()
            self._tick = asyncio.Event()
            await asyncio.sleep(0)


class FakeLLM:
    """Enough of `AsyncLLM` for both servicers: generate() yields DELTA RequestOutput look-alikes."""

    def __init__(self, clock: _Clock, max_tokens: int) -> None:
        self._clock = clock
        self._max_tokens = max_tokens
        self.marks: list[float] = []
        """perf_counter() when the engine is asked for a request, then when each of its outputs is handed out."""
        self.errored = False
        self.engine_core = SimpleNamespace()
        self.renderer = SimpleNamespace(process_for_engine=lambda prompt, arrival_time=None: prompt)
        self.model_config = SimpleNamespace(get_diff_sampling_param=dict)
        self.vllm_config = None

    def get_tokenizer(self) -> Any:
        return SimpleNamespace(max_chars_per_token=8)

    async def generate(self, prompt: Any, sampling_params: Any, request_id: str, **_: Any) -> AsyncGenerator[Any, None]:
        """vLLM's servicer reads `generate`."""
        self.marks.append(time.perf_counter())
        outputs = self._outputs(prompt, request_id)
        for _step in range(self._max_tokens):
            await self._clock.step()
            self.marks.append(time.perf_counter())
            yield next(outputs)

    async def add_request(self, request_id: str, prompt: Any, params: Any, **_: Any) -> FakeCollector:
        """phasescope's engine reads the request's output collector, as `AsyncLLM.generate` does."""
        self.marks.append(time.perf_counter())
        return FakeCollector(request_id, self._clock, self._outputs(prompt, request_id), self.marks)

    def _outputs(self, prompt: Any, request_id: str) -> Iterator[Any]:
        ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else []
        stats = _Stats()
        for i in range(self._max_tokens):
            now = time.monotonic()
            if i == 0:
                stats.first_token_ts = now
            stats.last_token_ts = now
            stats.num_generation_tokens = i + 1
            last = i == self._max_tokens - 1
            completion = SimpleNamespace(
                index=0,
                text="",
                token_ids=[100 + i % 50],
                logprobs=None,
                finish_reason="length" if last else None,
                stop_reason=None,
            )
            yield SimpleNamespace(
                request_id=request_id,
                prompt_token_ids=ids,
                outputs=[completion],
                finished=last,
                metrics=stats,
                num_cached_tokens=0,
                prompt_logprobs=None,
                kv_transfer_params=None,
            )

    async def abort(self, request_id: str, internal: bool = False) -> None:
        return None


class FakeCollector:
    """Enough of vLLM's `RequestOutputCollector`: the next output once the clock ticks."""

    def __init__(self, request_id: str, clock: _Clock, outputs: Iterator[Any], marks: list[float]) -> None:
        self.request_id = request_id
        self._clock = clock
        self._outputs = outputs
        self._marks = marks

    def get_nowait(self) -> None:
        return None

    async def get(self) -> Any:
        await self._clock.step()
        self._marks.append(time.perf_counter())
        return next(self._outputs)

    def close(self) -> None:
        return None


class FakeContext:
    def time_remaining(self) -> float | None:
        return None

    def set_trailing_metadata(self, metadata: Any) -> None:
        self.trailing = metadata

    def invocation_metadata(self) -> tuple[()]:
        return ()

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    def auth_context(self) -> dict[str, Any]:
        return {}

    async def abort(self, code: Any, details: str) -> None:
        raise RuntimeError(f"{code}: {details}")


def _request(i: int, max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=f"r{i}",
        tokenized=pb.TokenizedInput(input_ids=list(range(1, 17))),
        sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        stream=True,
    )


def phasescope_handler(llm: FakeLLM) -> Any:
    from phasescope.engine.base import ModelDescription
    from phasescope.engine.vllm.engine import VllmEngine
    from phasescope.serve.admission import Admission
    from phasescope.serve.app import REQUEST_RECORD_HOLD_SECONDS
    from phasescope.serve.engine_protocol.servicer import VllmEngineServicer
    from phasescope.serve.lifecycle import RequestPath
    from phasescope.telemetry.live import RecentLatencies
    from phasescope.telemetry.model.cost import model_cost_from_numbers
    from phasescope.telemetry.request.observer import ObserverGroup
    from phasescope.telemetry.request.prometheus import PrometheusRequestObserver

    description = ModelDescription(
        model_name="m", model_path="/m", max_context_length=4096, dtype="float32", vocab_size=32000,
        engine="vllm", engine_version="0", device="cpu", data_parallel_size=1, tensor_parallel_size=1,
        pipeline_parallel_size=1, cost=model_cost_from_numbers(1_000_000, "float32"), on_cpu=True,
    )  # fmt: skip
    engine = VllmEngine(llm, description)
    # Held as the server holds them; handed on before the CPU is read (`measure`).
    observers = ObserverGroup(
        [PrometheusRequestObserver(CollectorRegistry(), "m"), RecentLatencies()],
        hold_seconds=REQUEST_RECORD_HOLD_SECONDS,
    )
    path = RequestPath(observers, Admission(4096, 4096), "m")
    path.engine = engine
    servicer = VllmEngineServicer(path)
    return servicer.Generate, observers.hand_on  # it maps its own errors (`maps_own_errors`)


def vllm_handler(llm: FakeLLM) -> Any:
    from smg_grpc_servicer.vllm import servicer as smg  # type: ignore[import-untyped]  # vLLM's servicer ships no types

    servicer = smg.VllmEngineServicer.__new__(smg.VllmEngineServicer)
    servicer.engine = llm
    servicer._loads = smg.LoadTracker(rank_of=lambda request_id: smg._routed_rank(llm, request_id))
    servicer._mm_processor = None
    return servicer.Generate, lambda: None


async def _one(handler: Any, request: pb.GenerateRequest) -> int:
    written = 0
    async for response in handler(request, FakeContext()):
        response.SerializeToString()
        written += 1
    return written


async def measure(name: str, requests: int, max_tokens: int, concurrency: int) -> dict[str, float]:
    clock = _Clock()
    llm = FakeLLM(clock, max_tokens)
    handler, hand_on = phasescope_handler(llm) if name == "phasescope" else vllm_handler(llm)
    pending = [_request(i, max_tokens) for i in range(requests)]

    async def worker() -> None:
        while pending:
            await _one(handler, pending.pop())

    gc.collect()
    done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    ticker = asyncio.create_task(clock.run(done))
    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    hand_on()  # what is still held is part of the cost
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    done.set_result(None)
    await ticker
    tokens = requests * max_tokens
    return {"cpu_us_per_token": cpu / tokens * 1e6, "cpu_s": cpu, "wall_s": wall}


async def stages(name: str, requests: int) -> dict[str, list[float]]:
    """Two-token requests, each alone, one after another: for each, in µs, its intake (handler entered → the
    engine asked for it), its first output → its first chunk, and its end (the second chunk made → the handler
    done: the last chunk written, the `GenerateComplete`, the handler's exit)."""
    clock = _Clock()
    llm = FakeLLM(clock, 2)
    handler, hand_on = phasescope_handler(llm) if name == "phasescope" else vllm_handler(llm)
    done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    ticker = asyncio.create_task(clock.run(done))
    pending = [_request(i, 2) for i in range(requests)]
    measured: dict[str, list[float]] = {"intake": [], "first_output_to_chunk": [], "end": []}
    for index, request in enumerate(pending):
        llm.marks.clear()
        responses = handler(request, FakeContext()).__aiter__()
        entered = time.perf_counter()
        await anext(responses)
        first_chunk = time.perf_counter()
        await anext(responses)
        second_chunk = time.perf_counter()
        async for _ in responses:
            pass
        ended = time.perf_counter()
        asked, first_output = llm.marks[0], llm.marks[1]
        measured["intake"].append((asked - entered) * 1e6)
        measured["first_output_to_chunk"].append((first_chunk - first_output) * 1e6)
        measured["end"].append((ended - second_chunk) * 1e6)
        if index % 256 == 255:
            hand_on()  # as the server hands held records on between waves
    done.set_result(None)
    await ticker
    return measured


def print_stages(requests: int, repeats: int) -> None:
    """`--stages`: each server's p10 and p50 per stage, repeat by repeat (the first 10 % of requests left out)."""
    for repeat in range(repeats):
        for name in ("vllm", "phasescope"):
            gc.collect()
            measured = asyncio.run(stages(name, requests))
            cells = []
            for stage, values in measured.items():
                kept = sorted(values[len(values) // 10 :])
                cells.append(f"{stage} {kept[len(kept) // 10]:6.1f} / {kept[len(kept) // 2]:6.1f}")
            print(f"#{repeat + 1} {name:10s} µs p10 / p50: " + "  ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", choices=("phasescope", "vllm"), default=None)
    parser.add_argument("--stages", action="store_true", help="split each request's own cost into its stages")
    args = parser.parse_args()
    logging.disable(logging.INFO)  # vLLM's servicer logs every request at INFO; its cost is not the subject
    if args.stages:
        print_stages(args.requests, args.repeats)
        return
    names = [args.only] if args.only else ["vllm", "phasescope"]
    results: dict[str, list[float]] = {name: [] for name in names}
    for repeat in range(args.repeats):
        for name in names:  # interleaved, so drift on the machine lands on both
            figures = asyncio.run(measure(name, args.requests, args.max_tokens, args.concurrency))
            results[name].append(figures["cpu_us_per_token"])
            print(f"#{repeat + 1} {name:10s} {figures['cpu_us_per_token']:6.2f} µs CPU per token")
    summary = {name: statistics.median(values) for name, values in results.items()}
    print(json.dumps({"median_cpu_us_per_token": summary, "runs": results}, indent=1))


if __name__ == "__main__":
    main()
