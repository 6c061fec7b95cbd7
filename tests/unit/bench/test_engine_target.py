"""VllmEngineTarget against an in-process VllmEngine server with scripted chunks: what it sends (token ids,
greedy ignore_eos sampling, a stream, a request id of its own) and what it records (every token's arrival,
the counts), and how a failure surfaces (as the other targets': raised, then counted by the run loop)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc

from phasescope.bench.loop import run_point
from phasescope.bench.targets import VllmEngineTarget
from phasescope.bench.workload import BenchRequest, RequestRecord

GAP = 0.05
"""Seconds between the scripted chunks."""


class WordTokenizer:
    """One id per word (its length), 1 in front when special tokens are added; a chat is `<user> ` + content."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([1] if add_special_tokens else []) + [len(word) for word in text.split()]

    def apply_chat_template(
        self, conversation: list[dict[str, str]], *, tokenize: bool, add_generation_prompt: bool
    ) -> Any:
        assert not tokenize
        assert add_generation_prompt
        return "<user> " + conversation[-1]["content"]


class ScriptedEngine(pb_grpc.VllmEngineServicer):
    """Streams `chunks` (token ids per step) GAP apart, then a GenerateComplete repeating the last step's ids;
    `fail` aborts the call after the first chunk instead, `finish_reason` names how the request ended, and
    `complete=False` ends the stream without the GenerateComplete."""

    def __init__(
        self,
        chunks: list[list[int]],
        *,
        fail: grpc.StatusCode | None = None,
        finish_reason: str = "length",
        complete: bool = True,
    ) -> None:
        self.chunks = chunks
        self.fail = fail
        self.finish_reason = finish_reason
        self.complete = complete
        self.requests: list[pb.GenerateRequest] = []

    async def Generate(self, request: pb.GenerateRequest, context: Any) -> AsyncIterator[pb.GenerateResponse]:
        self.requests.append(request)
        prompt = len(request.tokenized.input_ids)
        for number, ids in enumerate(self.chunks):
            if number:
                await asyncio.sleep(GAP)
            yield pb.GenerateResponse(
                chunk=pb.GenerateStreamChunk(token_ids=ids, prompt_tokens=prompt, completion_tokens=len(ids))
            )
            if self.fail is not None:
                await context.abort(self.fail, "scripted failure")
        if self.complete:
            last = self.chunks[-1]
            yield pb.GenerateResponse(
                complete=pb.GenerateComplete(
                    output_ids=last, finish_reason=self.finish_reason, prompt_tokens=prompt, completion_tokens=len(last)
                )
            )


@asynccontextmanager
async def serving(engine: ScriptedEngine, api: str = "prompt") -> AsyncIterator[VllmEngineTarget]:
    server = grpc.aio.server()
    pb_grpc.add_VllmEngineServicer_to_server(engine, server)  # type: ignore[no-untyped-call]  # its grpc module has no stubs
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    target = VllmEngineTarget(f"127.0.0.1:{port}", "engine-under-test", WordTokenizer(), pid=os.getpid(), api=api)
    try:
        yield target
    finally:
        await target.close()
        await server.stop(grace=None)


REQUEST = BenchRequest(index=3, prompt="sun sea river", max_tokens=4)


async def test_every_token_is_timed_at_its_chunk_and_the_counts_are_the_streams() -> None:
    engine = ScriptedEngine([[11], [12, 13], [14]])
    async with serving(engine) as target:
        record = RequestRecord(REQUEST.index, 0.0)
        await target.stream(REQUEST, record)
    assert target.name == "engine-under-test"
    # The complete repeats the last step's ids: counted once, from the chunk.
    assert record.output_tokens == 4
    assert len(record.token_times) == 4
    first, second, third, fourth = record.token_times
    assert second == third  # two ids in one chunk: two tokens arriving together
    assert second - first >= GAP * 0.9
    assert fourth - third >= GAP * 0.9
    assert record.prompt_tokens == 4  # the server's count: 1 (special) + 3 words


async def test_the_request_carries_token_ids_greedy_ignore_eos_sampling_and_its_own_id() -> None:
    engine = ScriptedEngine([[11]])
    async with serving(engine) as target:
        for _ in range(2):
            await target.stream(REQUEST, RequestRecord(REQUEST.index, 0.0))
    first, second = engine.requests
    assert first.WhichOneof("input") == "tokenized"
    assert list(first.tokenized.input_ids) == [1, 3, 3, 5]
    sampling = first.sampling_params
    assert sampling.HasField("max_tokens")
    assert sampling.max_tokens == 4
    assert sampling.HasField("temperature")
    assert sampling.temperature == 0.0
    assert sampling.ignore_eos
    assert first.stream
    assert first.request_id
    assert first.request_id != second.request_id


async def test_a_chat_goes_through_the_chat_template_without_added_special_tokens() -> None:
    engine = ScriptedEngine([[11]])
    async with serving(engine, api="chat") as target:
        await target.stream(REQUEST, RequestRecord(REQUEST.index, 0.0))
    (request,) = engine.requests
    assert list(request.tokenized.input_ids) == [6, 3, 3, 5]  # "<user> sun sea river", no 1 in front


async def test_an_rpc_error_is_raised_and_the_run_loop_counts_it() -> None:
    engine = ScriptedEngine([[11], [12]], fail=grpc.StatusCode.RESOURCE_EXHAUSTED)
    async with serving(engine) as target:
        record = RequestRecord(REQUEST.index, 0.0)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await target.stream(REQUEST, record)
        assert raised.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert record.output_tokens == 1  # what came before the failure
        records, _ = await run_point(target, [REQUEST], concurrency=1, rate=None, seed=0, progress=lambda: None)
    (failed,) = records
    assert "AioRpcError" in failed.error
    assert "scripted failure" in failed.error


async def test_an_aborted_request_or_a_stream_without_its_complete_fails() -> None:
    async with serving(ScriptedEngine([[11]], finish_reason="abort")) as target:
        with pytest.raises(RuntimeError, match="'abort'"):
            await target.stream(REQUEST, RequestRecord(REQUEST.index, 0.0))
    async with serving(ScriptedEngine([[11]], complete=False)) as target:
        with pytest.raises(RuntimeError, match="without a GenerateComplete"):
            await target.stream(REQUEST, RequestRecord(REQUEST.index, 0.0))


async def test_the_cpu_seconds_are_the_serving_processes_and_none_without_one() -> None:
    async with serving(ScriptedEngine([[11]])) as target:
        seconds = target.frontend_cpu_seconds()
        assert seconds is not None
        assert seconds > 0
        unmeasured = VllmEngineTarget(target.address, "no-pid", WordTokenizer())
        assert unmeasured.frontend_cpu_seconds() is None
        assert unmeasured.metrics_url is None
        assert unmeasured.scrape_url is None
        await unmeasured.close()
