"""The engine interface the servicer depends on, and the values that cross it.

`phasescope.engine.vllm.engine` implements it over vLLM's `AsyncLLM`. Keeping vLLM behind
this seam keeps its unstable interfaces in one module.
"""

from __future__ import annotations

import re
from collections.abc import AsyncGenerator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from phasescope.engine.request import ModelLimits, ParsedInput, SamplingSpec
from phasescope.telemetry.model.adapter import AdapterShape
from phasescope.telemetry.model.cost import ModelCost
from phasescope.telemetry.request.adapters import BASE_ADAPTER, OTHER_ADAPTERS
from phasescope.telemetry.request.phases import EngineTimestamps


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """How to start an engine: the part of the server's settings the engine reads (each field is
    the `phasescope serve` flag of the same name, documented there)."""

    dtype: str = "auto"
    kv_cache_gib: float | None = None
    max_model_len: int | None = None
    enforce_eager: bool = False
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    stream_interval: int = 1
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str = ""
    kv_events_config: str = ""
    """vLLM's `KVEventsConfig` as a JSON object (empty: no KV-cache events)."""
    speculative_config: str = ""
    """vLLM's speculative decoding configuration as a JSON object (empty: off)."""
    kv_transfer_config: str = ""
    """vLLM's `KVTransferConfig` as a JSON object: the KV connector of a disaggregated prefill/decode pool (empty:
    none)."""
    telemetry_listen: str = ""
    """Where the hub the engine cores publish their steps to binds (a ZMQ address; empty: a private ipc path)."""
    lora: bool = False
    """Whether the engine runs LoRA adapters (vLLM's enable_lora)."""
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_modules: tuple[tuple[str, str], ...] = ()
    """The adapters served from the start: (name, PEFT folder) pairs."""


class EngineConfigError(ValueError):
    """The engine refuses a configuration it was given (one line naming the setting and the field)."""


@dataclass(frozen=True, slots=True)
class Speculative:
    """How the engine speculates: its drafter and how many tokens it proposes a step."""

    method: str
    """vLLM's method: "ngram", "draft_model", "eagle", "mtp", …"""
    num_speculative_tokens: int
    """k: tokens the drafter proposes per sequence per step; a verify step checks k + 1 positions."""
    draft_model: str = ""
    """The drafter's weights, for a method that has a model (empty for n-gram)."""
    draft_cost: ModelCost | None = None
    """The drafter's cost per device, for a method that has a model (None: the drafter is host code)."""


@dataclass(frozen=True, slots=True)
class KvConnector:
    """The engine's KV connector (--kv-transfer-config), as vLLM's own worker reports it to a gateway."""

    connector: str
    """The connector that moves a request's KV between the prefill and the decode worker: vLLM's name for it (e.g.
    "NixlConnector"), a MultiConnector's one mover where it has one (smg-grpc-servicer's `resolve_pd_connector`)."""
    role: str
    """"kv_producer" (a prefill worker), "kv_consumer" (a decode worker) or "kv_both"."""
    engine_id: str
    """The id peers know this engine by (the mover's own where a MultiConnector's child names one; vLLM makes one
    up when the configuration gives none)."""


@dataclass(frozen=True, slots=True)
class KvEventPublisher:
    """Where one data-parallel rank of the engine publishes its KV-cache events (vLLM's ZMQ publisher)."""

    rank: int
    endpoint: str
    """The publisher's address as it binds it (e.g. tcp://*:5557)."""
    replay_endpoint: str | None = None
    """Where missed events are asked for again, when the publisher keeps them."""
    topic: str = ""
    high_water_mark: int | None = None


# What the adapter label of the request series says for the base model, and for adapters past the label limit.
RESERVED_ADAPTER_NAMES = (BASE_ADAPTER, OTHER_ADAPTERS)
_ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def adapter_name_problem(name: str) -> str | None:
    """Why `name` cannot name an adapter (it becomes a series label and a request field's value), or None."""
    if not _ADAPTER_NAME.fullmatch(name):
        return f"an adapter name is 1 to 64 letters, digits, '.', '_' or '-' (a letter or digit first), got {name!r}"
    if name in RESERVED_ADAPTER_NAMES:
        return f"{' and '.join(RESERVED_ADAPTER_NAMES)} are the series' own labels, not adapter names"
    return None


def unknown_adapter(name: str, served: Iterable[str]) -> str:
    """What a request for an adapter the engine does not serve is told (the served ones, in the order loaded)."""
    return f"no adapter named {name!r} is served (served: {', '.join(served) or 'none'})"


@dataclass(frozen=True, slots=True)
class Adapter:
    """A LoRA adapter the engine serves over its base model, by the name requests select it with."""

    name: str
    path: str
    shape: AdapterShape


@dataclass(frozen=True, slots=True)
class ModelDescription:
    """What GetModelInfo reports."""

    model_name: str
    model_path: str
    max_context_length: int
    dtype: str
    vocab_size: int
    engine: str
    engine_version: str
    device: str
    data_parallel_size: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    cost: ModelCost
    on_cpu: bool
    model_type: str = ""
    """The checkpoint's `model_type` (e.g. "llama")."""
    architectures: tuple[str, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    """The end-of-sequence ids the model's config declares."""
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    sampling_defaults: tuple[tuple[str, float], ...] = ()
    """The generation config's sampling defaults the engine applies when a request sets none."""
    max_num_seqs: int = 0
    """The engine's running batch (requests it runs at once)."""
    kv_cache_capacity_tokens: int = 0
    """Tokens the KV cache holds, per engine: its blocks × tokens per block (0 when unknown)."""
    kv_cache_block_size: int = 0
    kv_cache_dtype: str = "auto"
    kv_event_publishers: tuple[KvEventPublisher, ...] = ()
    """The engine's KV-cache event publishers, one per data-parallel rank (none: events are off)."""
    speculative: Speculative | None = None
    """Speculative decoding, when it is on."""
    kv_connector: KvConnector | None = None
    """The KV connector of a disaggregated prefill/decode pool (None: the engine runs none, and a request that asks
    for a KV transfer is refused)."""
    max_loras: int = 0
    """Distinct LoRA adapters one step can run (vLLM's max_loras); 0: the engine runs no adapters."""
    max_lora_rank: int = 0
    adapters_by_id: Mapping[int, Adapter] = field(default_factory=dict)
    """Every adapter the engine has loaded, by its id in the engine (what a step's report names): kept up to date
    by the engine as adapters are loaded, and kept after one is unloaded (its last steps may still be on their
    way)."""


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One output token's log probability, and the most likely tokens at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    """(token id, log probability) of the `SamplingSpec.logprobs` most likely tokens, most likely first."""


@dataclass(frozen=True, slots=True)
class EngineStep:
    """What one engine step produced for one request (a delta, not the running total)."""

    text: str
    token_ids: tuple[int, ...]
    finished: bool
    """The request's last step: every sample has finished."""
    finish_reason: str | None
    """"stop", "length" or "abort" on the sample's last step, else None."""
    completion_tokens: int
    """Tokens generated so far, this step included."""
    cached_prompt_tokens: int
    stamps: EngineTimestamps | None
    """The engine's timestamps as of this step; None when the engine keeps no stats."""
    engine_index: int = 0
    """The engine core serving the request (data parallelism), whose steps its decode shares."""
    stop_reason: int | str | None = None
    """On a "stop" finish: the stop token id or stop string that ended it (None: end of sequence)."""
    logprobs: tuple[TokenLogprob, ...] = ()
    """One per token of `token_ids` when the request asked for log probabilities, else empty."""
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    """On the first step of a request that asked for them: one per prompt token after the first
    (nothing precedes the first, so it has none), else empty."""
    index: int = 0
    """The sample this step belongs to (0 to `SamplingSpec.n` − 1): each is its own sequence, whose
    counts and stamps are its own."""
    drafted_tokens: int = 0
    """On the sample's last step, under speculative decoding: the tokens its drafter proposed."""
    accepted_tokens: int = 0
    """On the sample's last step, under speculative decoding: the drafted tokens the verify steps kept."""
    kv_transfer_params: dict[str, Any] | None = None
    """On the request's last step, what the KV connector hands the next worker (e.g. a prefill worker's
    `remote_host`, `remote_port` and block ids for the decode worker), as vLLM returns it; None: nothing."""


class Engine(Protocol):
    @property
    def description(self) -> ModelDescription: ...

    @property
    def limits(self) -> ModelLimits: ...

    @property
    def is_dead(self) -> bool:
        """True once the engine can no longer serve (its core process died)."""

    def tokenize(self, parsed: ParsedInput) -> list[int]:
        """Token ids the model sees for this input (chat rendered with the model's template)."""

    @property
    def adapters(self) -> tuple[Adapter, ...]:
        """The LoRA adapters it serves now, in the order they were loaded (none: LoRA is off or none is loaded)."""

    async def load_adapter(self, name: str, path: str) -> Adapter:
        """Check the adapter folder against the base model and load it under `name`; AdapterError (one line) when
        it is no adapter or not one for this model, NotConfiguredError when the engine runs no adapters."""

    async def unload_adapter(self, name: str) -> Adapter:
        """Stop serving the adapter (requests running with it finish); NotFoundError for a name it does not serve."""

    def generate(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingSpec, adapter: str = ""
    ) -> AsyncGenerator[EngineStep, None]:
        """Stream the request's steps; closing the iterator aborts the engine request. With `sampling.n`
        > 1 the samples' steps interleave, each with its `index`, and the last one is `finished`. `adapter`: the
        LoRA adapter it runs with, by name ("": the base model).

        Sampling the engine refuses raises InvalidRequestError from this call, before
        the request reaches the engine.
        """

    async def abort(self, request_id: str) -> None:
        """Stop a request the engine runs (an out-of-band abort, e.g. a gateway's): its steps end with a
        last step whose finish_reason is "abort". An id the engine does not run is ignored."""

    async def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache's reusable blocks (requests in flight keep theirs); False when refused."""

    async def warm_up(self) -> None:
        """Run one tiny request so the first client does not pay for lazy initialisation."""

    async def close(self) -> None:
        """Stop the engine processes; safe to call twice."""
