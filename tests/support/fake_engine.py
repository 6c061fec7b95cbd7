"""A scripted `Engine` for unit tests of the request path: no vLLM, every rare path on demand.

Each request plays a `Script`: a list of steps (tokens with the engine's
timestamps), optionally a failure after some steps, or a pause that only a
cancel ends. Timestamps are `time.monotonic()` readings taken as each step is
played, so they sit on the clock the servicer uses (phasescope.telemetry.request.phases). The
engine records which requests were aborted (their step stream closed early)
and which ran to the end, as vLLM's request table would.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from phasescope.engine.base import Adapter, EngineStep, KvConnector, ModelDescription, TokenLogprob, unknown_adapter
from phasescope.engine.request import ModelLimits, ParsedInput, SamplingSpec
from phasescope.errors import AlreadyExistsError, InvalidRequestError, NotConfiguredError, NotFoundError
from phasescope.telemetry.model.adapter import AdapterError, read_adapter
from phasescope.telemetry.model.cost import model_cost_from_config
from phasescope.telemetry.request.phases import EngineTimestamps

CONFIG = {
    "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
    "intermediate_size": 128,
}  # fmt: skip
VOCABULARY = 1_000


@dataclass
class Script:
    """What the engine does with one request."""

    tokens: list[int] = field(default_factory=lambda: [11, 12, 13])
    finish_reason: str = "length"
    queue_seconds: float = 0.0
    """Time between the request's arrival in the engine and its first schedule."""
    step_seconds: float = 0.0
    """Time each step takes (the first one is the prefill)."""
    fail_after: int | None = None
    """Raise `failure` after this many steps."""
    failure: BaseException = field(default_factory=lambda: RuntimeError("scripted failure"))
    hang_after: int | None = None
    """After this many steps, wait until the request is cancelled."""
    stop_reason: int | str | None = None
    """What the last step says ended it (a stop token id or string)."""
    cached_prompt_tokens: int = 0
    sample_cached_prompt_tokens: int = 0
    """With n > 1: what each sample after the first finds cached (the first's prompt blocks)."""
    kv_transfer_params: dict[str, Any] | None = None
    """What the KV connector answers on the last step (a prefill worker's parameters for the decode worker)."""


def scripted_logprob(token: int, top: int) -> TokenLogprob:
    """What the scripted engine reports for a token when asked: it was the likeliest, at -0.25, and the
    alternatives follow it one nat apart (token + 1, token + 2, ...)."""
    alternatives = tuple((token + rank, -0.25 - rank) for rank in range(top))
    return TokenLogprob(token, -0.25, alternatives)


class ScriptedEngine:
    """Implements `phasescope.engine.base.Engine`; `script_for` picks each request's script by its prompt."""

    def __init__(
        self,
        script_for: Callable[[list[int]], Script] = lambda prompt: Script(),
        *,
        max_model_len: int = 256,
        refuse_temperature_above: float = 2.0,
        model_path: str = "/scripted",
        kv_connector: KvConnector | None = None,
        max_loras: int = 0,
    ) -> None:
        """`kv_connector`: the engine runs that KV connector (--kv-transfer-config), so requests may carry
        KV-transfer parameters (each request's are in `sampling`). `max_loras` > 0: it runs LoRA adapters, each
        folder read against its CONFIG (`load_adapter`); each request's adapter is in `adapter_of`."""
        self._script_for = script_for
        self._refuse_temperature_above = refuse_temperature_above
        self.dead = False
        self.closed = False
        self.warmed_up = False
        self.started: list[str] = []
        self.sampling: dict[str, SamplingSpec] = {}
        """Each started request's sampling, as the engine was asked for it."""
        self.aborted: list[str] = []
        self.finished: list[str] = []
        self.served_adapters: dict[str, Adapter] = {}
        self.adapter_of: dict[str, str] = {}
        cost = model_cost_from_config(CONFIG, parameter_count=1_000_000, dtype="float32")
        self._limits = ModelLimits(max_model_len=max_model_len, vocab_size=VOCABULARY, max_chars_per_token=8)
        self._description = ModelDescription(
            model_name="scripted",
            model_path=model_path,
            max_context_length=max_model_len,
            dtype="float32",
            vocab_size=VOCABULARY,
            engine="scripted",
            engine_version="0",
            device="cpu (scripted)",
            data_parallel_size=1,
            tensor_parallel_size=1,
            pipeline_parallel_size=1,
            cost=cost,
            on_cpu=True,
            model_type="llama",
            architectures=("LlamaForCausalLM",),
            eos_token_ids=(2,),
            bos_token_id=1,
            sampling_defaults=(("temperature", 0.6),),
            max_num_seqs=4,
            kv_cache_capacity_tokens=4096,
            kv_cache_block_size=16,
            kv_connector=kv_connector,
            max_loras=max_loras,
            max_lora_rank=16 if max_loras else 0,
        )
        self.prefix_cache_resets = 0
        self._aborts: dict[str, asyncio.Event] = {}

    @property
    def description(self) -> ModelDescription:
        return self._description

    @property
    def limits(self) -> ModelLimits:
        return self._limits

    @property
    def is_dead(self) -> bool:
        return self.dead

    def tokenize(self, parsed: ParsedInput) -> list[int]:
        """One token per word, its length as id: deterministic and easy to reason about."""
        if parsed.kind == "token_ids":
            return list(parsed.token_ids)
        text = parsed.prompt if parsed.kind == "prompt" else " ".join(turn.content for turn in parsed.chat)
        return [len(word) % VOCABULARY for word in text.split()] or [1]

    @property
    def adapters(self) -> tuple[Adapter, ...]:
        return tuple(self.served_adapters.values())

    async def load_adapter(self, name: str, path: str) -> Adapter:
        if not self._description.max_loras:
            raise NotConfiguredError("name", "this worker runs no adapters")
        if name in self.served_adapters:
            raise AlreadyExistsError("name", f"an adapter named {name!r} is served already")
        try:
            shape = read_adapter(Path(path), CONFIG, self._description.max_lora_rank)
        except AdapterError as exc:
            raise InvalidRequestError("path", str(exc)) from exc
        adapter = self.served_adapters[name] = Adapter(name, path, shape)
        return adapter

    async def unload_adapter(self, name: str) -> Adapter:
        if name not in self.served_adapters:
            raise NotFoundError("name", unknown_adapter(name, self.served_adapters))
        return self.served_adapters.pop(name)

    def generate(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingSpec, adapter: str = ""
    ) -> AsyncGenerator[EngineStep, None]:
        if adapter and adapter not in self.served_adapters:
            raise NotFoundError("adapter", unknown_adapter(adapter, self.served_adapters))
        self.adapter_of[request_id] = adapter
        if sampling.temperature is not None and sampling.temperature > self._refuse_temperature_above:
            raise InvalidRequestError("sampling.temperature", f"must be at most {self._refuse_temperature_above:g}")
        if sampling.n > 1:
            return self._play_samples(request_id, self._script_for(prompt_token_ids), sampling)
        return self._play(request_id, self._script_for(prompt_token_ids), sampling, tuple(prompt_token_ids))

    async def _play_samples(
        self, request_id: str, script: Script, sampling: SamplingSpec
    ) -> AsyncGenerator[EngineStep, None]:
        """n samples stepping together, as the engine batches them: sample i's tokens are the script's
        + 100 × i; each later sample finds `sample_cached_prompt_tokens` of the prompt cached."""
        self.started.append(request_id)
        self.sampling[request_id] = sampling
        queued = time.monotonic()
        tokens = script.tokens[: sampling.max_tokens]
        await asyncio.sleep(script.queue_seconds)
        scheduled = time.monotonic()
        first = 0.0
        for position, token in enumerate(tokens):
            await asyncio.sleep(script.step_seconds)
            now = time.monotonic()
            first = first or now
            last = position == len(tokens) - 1
            for index in range(sampling.n):
                yield EngineStep(
                    text=f"t{token + 100 * index} ",
                    token_ids=(token + 100 * index,),
                    finished=last and index == sampling.n - 1,
                    finish_reason=script.finish_reason if last else None,
                    completion_tokens=position + 1,
                    cached_prompt_tokens=script.cached_prompt_tokens
                    if index == 0
                    else script.sample_cached_prompt_tokens,
                    stamps=EngineTimestamps(queued, scheduled, first, now),
                    index=index,
                    kv_transfer_params=script.kv_transfer_params if last else None,
                )
        self.finished.append(request_id)

    async def _play(
        self, request_id: str, script: Script, sampling: SamplingSpec, prompt: tuple[int, ...] = ()
    ) -> AsyncGenerator[EngineStep, None]:
        self.started.append(request_id)
        self.sampling[request_id] = sampling
        aborted = self._aborts[request_id] = asyncio.Event()
        queued = time.monotonic()
        tokens = script.tokens[: sampling.max_tokens]
        first = 0.0
        try:
            await asyncio.sleep(script.queue_seconds)
            scheduled = time.monotonic()
            for index, token in enumerate(tokens):
                if script.fail_after is not None and index == script.fail_after:
                    raise script.failure
                if script.hang_after is not None and index == script.hang_after:
                    await aborted.wait()  # only a cancel or an abort ends it
                if aborted.is_set():
                    # As vLLM does: a last output, finished with "abort".
                    self.aborted.append(request_id)
                    yield EngineStep("", (), True, "abort", index, script.cached_prompt_tokens, None)
                    return
                await asyncio.sleep(script.step_seconds)
                now = time.monotonic()
                first = first or now
                last = index == len(tokens) - 1
                yield EngineStep(
                    text=f"t{token} ",
                    token_ids=(token,),
                    finished=last,
                    finish_reason=script.finish_reason if last else None,
                    completion_tokens=index + 1,
                    cached_prompt_tokens=script.cached_prompt_tokens,
                    stamps=EngineTimestamps(queued, scheduled, first, now),
                    stop_reason=script.stop_reason if last else None,
                    kv_transfer_params=script.kv_transfer_params if last else None,
                    logprobs=(scripted_logprob(token, sampling.logprobs),) if sampling.logprobs is not None else (),
                    prompt_logprobs=tuple(scripted_logprob(t, sampling.prompt_logprobs) for t in prompt[1:])
                    if sampling.prompt_logprobs is not None and index == 0
                    else (),
                )
        except (GeneratorExit, asyncio.CancelledError):
            self.aborted.append(request_id)
            raise
        finally:
            del self._aborts[request_id]
        self.finished.append(request_id)

    async def abort(self, request_id: str) -> None:
        if request_id in self._aborts:
            self._aborts[request_id].set()

    async def reset_prefix_cache(self) -> bool:
        self.prefix_cache_resets += 1
        return True

    async def warm_up(self) -> None:
        self.warmed_up = True

    async def close(self) -> None:
        self.closed = True
