"""What a sweep streams from: phasescope over gRPC, vLLM's engine protocol over gRPC, an OpenAI server over HTTP
(vLLM's, or a gateway's), vLLM's AsyncLLM in this process.

Each target fills a `RequestRecord` with the arrival time of every token and
reports the CPU seconds of its serving front-end process (None when there is
no separate process to measure). `api` is `prompt` (a completion) or `chat` (the
prompt as one user message, through the model's chat template: phasescope's
`Chat` input, vLLM's `/v1/chat/completions`, the tokenizer's template in process and
for the engine protocol, whose requests carry token ids).
"""

from __future__ import annotations

import json
import time
import uuid
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
        self, address: str, metrics_url: str | None, pid: int | None, api: str = "prompt", token_ids_only: bool = False,
        *, name: str = "phasescope",
    ) -> None:  # fmt: skip
        import grpc

        from phasescope.v1 import inference_pb2_grpc as pb_grpc

        self.name = name
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
                adapter=request.adapter,
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
    """An OpenAI-compatible server over HTTP: vLLM's (`/metrics` read during a run), or a gateway's (`scrape` off)."""

    def __init__(
        self,
        base_url: str,
        model: str,
        pid: int | None,
        api: str = "prompt",
        *,
        name: str = "vllm-openai",
        scrape: bool = True,
    ) -> None:
        import aiohttp

        self.name = name
        self.metrics_url: str | None = None
        self.scrape_url: str | None = f"{base_url}/metrics" if scrape else None
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


class Tokenizer(Protocol):
    """What the engine-protocol target needs of a tokenizer (a transformers tokenizer has both)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def apply_chat_template(self, conversation: list[dict[str, str]], *, tokenize: bool,
                            add_generation_prompt: bool) -> Any: ...  # fmt: skip


def load_tokenizer(model_path: str) -> Tokenizer:
    """The model's tokenizer as the engine loads it (transformers' AutoTokenizer over the model folder)."""
    from transformers import AutoTokenizer

    tokenizer: Tokenizer = AutoTokenizer.from_pretrained(model_path)
    return tokenizer


class VllmEngineTarget:
    """vLLM's engine protocol (`vllm.grpc.engine.VllmEngine`) at any endpoint: phasescope's or vLLM's own worker.

    Each request is sent as the smg gateway sends it: the prompt tokenised here once (for `chat`, through the
    chat template and then without added special tokens, as the engines render a chat), `TokenizedInput`
    ids in, greedy `ignore_eos` sampling, `stream=True` and a request id of its own. The stream is a chunk per
    engine step (that step's new token ids: k ids are k tokens arriving together), then a `GenerateComplete`
    that repeats the last step's ids with the finish reason: tokens are counted from the chunks only. The
    tokenisation is in the request's TTFT, as a gateway's is (tens of microseconds for the bench's prompts).
    """

    def __init__(
        self,
        address: str,
        name: str,
        tokenizer: str | Tokenizer,
        *,
        pid: int | None = None,
        api: str = "prompt",
        metrics_url: str | None = None,
    ) -> None:
        """`tokenizer`: a model folder (loaded here, once) or a loaded tokenizer; `metrics_url`: the server's
        /metrics when it has one (phasescope's), read during a run as for the other targets."""
        import grpc
        from smg_grpc_proto.generated import vllm_engine_pb2_grpc

        self.name = name
        self.api = api
        self.address = address
        self.metrics_url = self.scrape_url = metrics_url
        self._pid = pid
        self._tokenizer = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        self._channel = grpc.aio.insecure_channel(address)
        self._stub = vllm_engine_pb2_grpc.VllmEngineStub(self._channel)  # type: ignore[no-untyped-call]  # its grpc module has no stubs

    def token_ids(self, request: BenchRequest) -> list[int]:
        """The request's prompt as the engine would tokenise it."""
        if self.api == "chat":
            messages = [{"role": "user", "content": request.prompt}]
            rendered = self._tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            # The template already wrote the special tokens; encoding must not add more.
            return list(self._tokenizer.encode(str(rendered), add_special_tokens=False))
        return list(self._tokenizer.encode(request.prompt))

    async def stream(self, request: BenchRequest, record: RequestRecord) -> None:
        from smg_grpc_proto.generated import vllm_engine_pb2 as pb

        message = pb.GenerateRequest(
            request_id=f"bench-{request.index}-{uuid.uuid4().hex}",
            tokenized=pb.TokenizedInput(input_ids=self.token_ids(request)),
            sampling_params=pb.SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True),
            stream=True,
        )
        finish_reason: str | None = None
        call: Any = self._stub.Generate(message, timeout=600)
        async for response in call:
            now = time.perf_counter()
            if response.HasField("chunk"):
                chunk = response.chunk
                record.token_times.extend([now] * len(chunk.token_ids))
                record.output_tokens += len(chunk.token_ids)
                record.prompt_tokens = chunk.prompt_tokens or record.prompt_tokens
            elif response.HasField("complete"):
                record.prompt_tokens = response.complete.prompt_tokens or record.prompt_tokens
                finish_reason = response.complete.finish_reason
        if finish_reason is None:
            raise RuntimeError("the stream ended without a GenerateComplete")
        if finish_reason in ("abort", "error"):
            raise RuntimeError(f"the request ended with finish reason {finish_reason!r}")

    def frontend_cpu_seconds(self) -> float | None:
        return _cpu(self._pid)

    async def close(self) -> None:
        await self._channel.close()


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
