"""What an engine knows of its model and device, from vLLM's configuration: read alike by the front end
(`engine.VllmEngine`) and by each engine core (`core_telemetry`, which tells a hub with no engine of its own)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from phasescope.telemetry.hardware.probe import cpu_name
from phasescope.telemetry.model.cost import ModelCost, model_cost_from_config, model_cost_from_numbers, read_checkpoint
from phasescope.telemetry.step.records import EngineFacts

logger = logging.getLogger(__name__)


def model_cost(hf_config: dict[str, Any], folder: Path | None, dtype: str, kv_cache_dtype: str) -> ModelCost:
    """The model's cost from its config and checkpoint (`folder`, None: the config alone); a figure that cannot be
    known is left out with one warning — the cost model never stops the server from starting."""
    checkpoint = read_checkpoint(folder) if folder is not None and folder.is_dir() else None
    try:
        return model_cost_from_config(hf_config, None, dtype, kv_cache_dtype, checkpoint)
    except ValueError as exc:
        parameters = checkpoint.elements if checkpoint is not None else 0
        logger.warning(
            "the cost model cannot read this model's shape (%s): modelled FLOPs use %d parameters only, "
            "KV-cache and attention terms are left out; vLLM's own estimates are unaffected",
            exc,
            parameters,
        )
        return model_cost_from_numbers(parameters, dtype)


def drafts_with_model(config: Any) -> bool:
    """Whether vLLM's speculative config drafts with a model (not host code: n-gram, suffix)."""
    return config.draft_model_config is not None and str(config.method) not in ("ngram", "suffix")


def draft_cost(config: Any, cache_dtype: str, devices: tuple[int, int]) -> ModelCost | None:
    """A draft model's cost per device (`devices`: tensor × pipeline parallel); None without one."""
    if config is None or not drafts_with_model(config):
        return None
    draft = config.draft_model_config
    # An MTP drafter is layers of the target's own checkpoint: its shape is in its config, not its files.
    folder = Path(str(draft.model)) if str(config.method) != "mtp" else None
    return model_cost(draft.hf_config.to_dict(), folder, str(draft.dtype).removeprefix("torch."), cache_dtype).sharded(
        *devices
    )


def device_name() -> str:
    """The device the engine runs on: the CPU's model name, or the accelerator's as its platform reports it."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return f"cpu ({cpu_name()})"
    try:
        return str(current_platform.get_device_name(0))
    except Exception:  # a platform that cannot name its device (vLLM's interface leaves it optional)
        return str(current_platform.device_type)


def engine_facts(vllm_config: Any, engine: int) -> EngineFacts:
    """An engine core's facts from its own configuration (its cache already sized)."""
    from vllm.platforms import current_platform

    model_config, cache, parallel = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    dtype = str(model_config.dtype).removeprefix("torch.")
    devices = (int(parallel.tensor_parallel_size), int(parallel.pipeline_parallel_size))
    speculative = vllm_config.speculative_config
    cost = model_cost(model_config.hf_config.to_dict(), Path(str(model_config.model)), dtype, str(cache.cache_dtype))
    return EngineFacts(
        engine=engine,
        model_name=str(model_config.served_model_name or model_config.model),
        model_path=str(model_config.model),
        dtype=dtype,
        device=device_name(),
        on_cpu=bool(current_platform.is_cpu()),
        cost=cost.sharded(*devices),
        data_parallel_size=int(parallel.data_parallel_size),
        kv_cache_capacity_tokens=int((cache.num_gpu_blocks or 0) * (cache.block_size or 0)),
        max_num_seqs=int(vllm_config.scheduler_config.max_num_seqs),
        tensor_parallel_size=devices[0],
        pipeline_parallel_size=devices[1],
        speculative_tokens=int(speculative.num_speculative_tokens or 0) if speculative is not None else 0,
        draft_cost=draft_cost(speculative, str(cache.cache_dtype), devices),
    )
