"""What a sweep streams from: phasescope over gRPC, vLLM's OpenAI server over HTTP, vLLM's AsyncLLM in this process.

Each target fills a `RequestRecord` with the arrival time of every token and
reports the CPU seconds of its serving front-end process (None when there is
no separate process to measure). `api` is `prompt` (a completion) or `chat` (the
prompt as one user message, through the model's chat template: phasescope's
`Chat` input, vLLM's `/v1/chat/completions`, the tokenizer's template in process).
"""

from __future__ import annotations

import json
import time
from typing import Any, Protocol

from phasescope.bench.workload import BenchRequest, RequestRecord


class Target(Protocol):
    name: str
    metrics_url: str | None
    """phasescope's /metrics: read for the server's own view of a run."""
    scrape_url: str | None
    """The server's /metrics, read during a run on the same cadence for every target that has one."""

    async def stream(self, request: BenchRequest, record: RequestRecord) -> None: ...

    def frontend_cpu_seconds(self) -> float | None: ...

    async def close(self) -> None: ...


def _cpu(pid: int | None) -> float | None:
    if pid is None:
        return None
    import psutil

    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


class PhasescopeTarget:
    def __init__(
        self, address: str, metrics_url: str | None, pid: int | None, api: str = "prompt", token_ids_only: bool = False
    ) -> None:
        import grpc

        from phasescope.v1 import inference_pb2_grpc as pb_grpc

        self.name = "phasescope"
        self.api = api
        self.address = address
        self.token_ids_only = token_ids_only
        self.metrics_url = self.scrape_url = metrics_url
        self._pid = pid
        self._channel = grpc.aio.insecure_channel(address)
        self._stub = pb_grpc.InferenceStub(self._channel)

    async def stream(self, request: BenchRequest, record: RequestRecord) -> None:
        from phasescope.client.client import build_request

        text = {"chat": [("user", request.prompt)]} if self.api == "chat" else {"prompt": request.prompt}
        call: Any = self._stub.GenerateStream(
            build_request(
                **text,
                max_tokens=request.max_tokens,
                ignore_eos=True,
                temperature=0.0,
                token_ids_only=self.token_ids_only,
            ),
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

    async def close(self) -> None:
        await self._channel.close()


class OpenAITarget:
    def __init__(self, base_url: str, model: str, pid: int | None, api: str = "prompt") -> None:
        import aiohttp

        self.name = "vllm-openai"
        self.metrics_url: str | None = None
        self.scrape_url: str | None = f"{base_url}/metrics"
        self.api = api
        self._url = f"{base_url}/v1/chat/completions" if api == "chat" else f"{base_url}/v1/completions"
        self._model = model
        self._pid = pid
        # No cap on connections (aiohttp's default of 100 would hold a concurrency-128 point to 100
        # streams), and a fresh connection per request: reusing kept-alive ones failed requests with
        # ServerDisconnectedError / "Can not write request body" under load on this machine, even
        # with idle ones dropped before uvicorn's 5 s keep-alive. A loopback connect costs far less
        # than a streamed request.
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        self._session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600))

    async def stream(self, request: BenchRequest, record: RequestRecord) -> None:
        text: dict[str, Any] = (
            {"messages": [{"role": "user", "content": request.prompt}]}
            if self.api == "chat"
            else {"prompt": request.prompt}
        )
        body = {
            "model": self._model,
            **text,
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
                    if choice.get("text") or (choice.get("delta") or {}).get("content"):
                        record.token_times.append(now)
                        record.output_tokens += 1

    def frontend_cpu_seconds(self) -> float | None:
        return _cpu(self._pid)

    async def close(self) -> None:
        await self._session.close()


class InProcessTarget:
    """vLLM's AsyncLLM in this process: no network, no serialisation: the engine's own limit."""

    def __init__(self, llm: Any, api: str = "prompt") -> None:
        self.name = "in-process"
        # No server: nothing to scrape, and no front-end process to measure.
        self.metrics_url: str | None = None
        self.scrape_url: str | None = None
        self.api = api
        self._llm = llm

    async def stream(self, request: BenchRequest, record: RequestRecord) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA
        )
        prompt = request.prompt
        if self.api == "chat":
            messages = [{"role": "user", "content": request.prompt}]
            prompt = self._llm.get_tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        async for output in self._llm.generate(prompt, params, f"bench-{request.index}-{time.monotonic_ns()}"):
            now = time.perf_counter()
            count = len(output.outputs[0].token_ids)
            record.token_times.extend([now] * count)
            record.output_tokens += count
            record.prompt_tokens = len(output.prompt_token_ids or [])

    def frontend_cpu_seconds(self) -> float | None:
        return None

    async def close(self) -> None:
        # Drop the engine with the shutdown: left to the interpreter's exit, AsyncLLM.__del__ runs after
        # the modules it calls are gone and prints a TypeError.
        llm, self._llm = self._llm, None
        llm.shutdown()
