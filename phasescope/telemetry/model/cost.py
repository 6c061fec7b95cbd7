"""What one model costs to run: parameters, weight bytes, KV-cache bytes, FLOPs per step.

Computed from the checkpoint and its Hugging Face config, never guessed from
the model's name. `ModelCost` describes the whole model; its per-step figures
(`weights_read`, `decode_flops`, `prefill_flops`, `device_*`) are **per device**,
like vLLM's own estimate (`num_flops_per_gpu`): the model's work divided between
its tensor-parallel × pipeline-parallel devices, so that they compare with one
device's peaks.

The approximations, written once:
- FLOPs: 2 per weight per token for every matrix a token goes through — the
  attention and MLP projections, the *active* experts of a mixture of experts
  (`num_experts_per_tok` of the routed experts, plus shared experts) and the LM
  head. An untied input embedding is a lookup: no FLOPs. In prefill the LM head
  runs for one token per request (the last prompt token), not for every prompt
  token. Attention over the context adds 4 × layers × context × (query heads ×
  head dim) per token (QKᵀ and AV); a prefill chunk of n tokens attends to about
  n²/2 earlier tokens of its own.
- Bytes read by a step: every weight once, except a mixture of experts' routed
  experts, of which a step reads those its tokens touch. With T tokens each
  routed to k of E experts, the expected number of distinct experts touched per
  MoE layer is E × (1 − (1 − k/E)^T) (uniform routing: real routers are skewed,
  so this is an upper estimate at small T); it grows from k at T = 1 to all E.
  Norms and biases are counted as weights; activations are not modelled (vLLM's
  estimate includes them).
- Weight bytes: parameters × the served dtype's element size, except for
  quantised checkpoints (a `quantization_config`), whose bytes are the stored
  element sizes and scales: read from the checkpoint when present, else
  estimated from the quantisation's bits and group size (embeddings and LM head
  stay in the activation dtype). FLOPs use the logical parameter count.
- Per device: weights, FLOPs and layers divide by TP × PP; KV heads divide by TP
  but never below one per device (vLLM replicates a KV head when TP exceeds the
  KV heads); a latent (MLA) cache is replicated on every tensor-parallel rank.
"""

from __future__ import annotations

import json
import logging
import math
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

logger = logging.getLogger(__name__)

_DTYPE_BYTES = {
    "float32": 4,
    "float": 4,
    "fp32": 4,
    "float16": 2,
    "half": 2,
    "fp16": 2,
    "bfloat16": 2,
    "bf16": 2,
    "float8": 1,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "fp8_inc": 1,
    "fp8_ds_mla": 1,
    "int8": 1,
}
_SAFETENSORS_DTYPE_BYTES = {
    "F64": 8,
    "I64": 8,
    "U64": 8,
    "F32": 4,
    "I32": 4,
    "U32": 4,
    "F16": 2,
    "BF16": 2,
    "I16": 2,
    "U16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}
# Model types whose MLP has no gate (two matrices, not three).
_UNGATED_MLP = frozenset({"gpt2", "gpt_neox", "gptj", "opt", "bloom", "falcon", "gpt_bigcode", "phi", "starcoder2"})
# Model types with a norm on each query and key head (Qwen3, Gemma 3, OLMo 2).
_QK_NORM = frozenset({"qwen3", "qwen3_moe", "gemma3", "gemma3_text", "olmo2"})
# Model types with four norms per layer (pre/post attention and pre/post MLP).
_FOUR_NORMS = frozenset({"gemma2", "gemma3", "gemma3_text"})
# Model types with biases on the query, key and value projections.
_QKV_BIAS = frozenset({"qwen2", "qwen2_moe"})


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype name such as "bfloat16" or "torch.float16"."""
    name = dtype.removeprefix("torch.").lower()
    try:
        return _DTYPE_BYTES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(sorted(_DTYPE_BYTES))}") from None


@dataclass(frozen=True, slots=True)
class CheckpointSize:
    """What a folder's safetensors files hold: tensor elements and their stored bytes."""

    elements: int
    """Elements stored (tied weights are stored, so counted, once); for a packed quantised
    checkpoint this is not the parameter count (eight int4 weights share one int32)."""
    stored_bytes: int


def read_checkpoint(folder: Path) -> CheckpointSize | None:
    """Sizes from each safetensors file's JSON header (the tensors are not read); None without any."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    elements = stored = 0
    for path in files:
        with path.open("rb") as handle:
            (header_length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(header_length))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            count = math.prod(int(dimension) for dimension in entry["shape"])
            elements += count
            begin, end = entry.get("data_offsets", (0, count * _SAFETENSORS_DTYPE_BYTES.get(entry["dtype"], 0)))
            stored += int(end) - int(begin)
    return CheckpointSize(elements, stored)


def count_checkpoint_parameters(folder: Path) -> int | None:
    """Elements stored in a folder's safetensors files; None when it has none (see `read_checkpoint`)."""
    size = read_checkpoint(folder)
    return size.elements if size is not None else None


@dataclass(frozen=True, slots=True)
class RoutedExperts:
    """The routed experts of a mixture-of-experts model."""

    count: int
    """Routed experts per MoE layer."""
    per_token: int
    """Experts each token is routed to (`num_experts_per_tok`)."""
    layers: int
    """Layers whose MLP is a mixture of experts."""
    parameters_per_expert: int

    @property
    def parameters(self) -> int:
        return self.layers * self.count * self.parameters_per_expert

    @property
    def inactive_parameters_per_token(self) -> int:
        return self.layers * (self.count - self.per_token) * self.parameters_per_expert

    def touched(self, tokens: float) -> float:
        """Expected distinct experts per MoE layer that `tokens` tokens are routed to (uniform routing)."""
        if tokens <= 0:
            return 0.0
        untouched_share: float = (1.0 - self.per_token / self.count) ** tokens
        return self.count * (1.0 - untouched_share)


@dataclass(frozen=True, slots=True)
class ModelCost:
    parameter_count: int
    """Logical parameters of the whole model: every expert, the embeddings once when tied."""
    bytes_per_parameter: float
    """Stored bytes per parameter, averaged over the model (the served dtype's element size
    unless the checkpoint is quantised)."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    kv_bytes_per_element: int
    attention_width: int = 0
    """Query heads × head dimension: the width attention computes over (differs from
    `hidden_size` in Gemma and some Qwen3 models); 0 falls back to `hidden_size`."""
    embedding_parameters: int = 0
    """The input embedding (vocabulary × hidden): a lookup, no FLOPs."""
    lm_head_parameters: int = 0
    """The output projection (vocabulary × hidden), run for every token that needs logits."""
    tied_embeddings: bool = True
    """The LM head is the input embedding (counted once in `parameter_count`)."""
    experts: RoutedExperts | None = None
    kv_latent_width: int = 0
    """Elements a latent-attention (MLA) cache keeps per token per layer (kv_lora_rank +
    rope dims, one "head" replicated on every rank); 0 for per-head K and V."""
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1

    def sharded(self, tensor_parallel_size: int, pipeline_parallel_size: int) -> ModelCost:
        """The same model, its per-step figures per device of a TP × PP deployment."""
        return replace(
            self,
            tensor_parallel_size=max(1, tensor_parallel_size),
            pipeline_parallel_size=max(1, pipeline_parallel_size),
        )

    @property
    def devices(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    # Whole-model figures (GetModelInfo, the calculator's header).

    @property
    def active_parameter_count(self) -> int:
        """Parameters one token goes through (all of them for a dense model)."""
        inactive = self.experts.inactive_parameters_per_token if self.experts else 0
        return self.parameter_count - inactive

    @property
    def weight_bytes(self) -> int:
        """Stored weight bytes of the whole model."""
        return round(self.parameter_count * self.bytes_per_parameter)

    @property
    def kv_cache_bytes_per_token(self) -> int:
        """KV-cache bytes per token of the whole model."""
        # KV bytes per token = 2 (K and V) × layers × kv_heads × head_dim × bytes per element;
        # grouped-query attention is respected by using the KV heads, not the query heads.
        # A latent (MLA) cache keeps one latent vector per layer instead.
        if self.kv_latent_width:
            return self.num_layers * self.kv_latent_width * self.kv_bytes_per_element
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_bytes_per_element

    # Per-device figures (the live gauges, the roofline calculator's rows).

    @property
    def device_weight_bytes(self) -> float:
        """Weight bytes resident on each device."""
        return self.weight_bytes / self.devices

    @property
    def device_kv_cache_bytes_per_token(self) -> float:
        """KV-cache bytes per token held on each device."""
        layers = self.num_layers / self.pipeline_parallel_size
        if self.kv_latent_width:
            return layers * self.kv_latent_width * self.kv_bytes_per_element
        heads = max(1, self.num_kv_heads // self.tensor_parallel_size) if self.num_kv_heads else 0
        return 2 * layers * heads * self.head_dim * self.kv_bytes_per_element

    def weights_read(self, tokens: float) -> float:
        """Weight bytes a step computing `tokens` tokens reads on each device (module docstring)."""
        if self.experts is None:
            return self.device_weight_bytes
        expert_bytes = self.experts.parameters_per_expert * self.bytes_per_parameter
        untouched = self.experts.layers * (self.experts.count - self.experts.touched(max(tokens, 1)))
        return (self.weight_bytes - untouched * expert_bytes) / self.devices

    @property
    def _matmul_parameters_per_token(self) -> int:
        """Active parameters a token multiplies by, the LM head left out (it runs per logits token)."""
        body = self.active_parameter_count - self.embedding_parameters
        if not self.tied_embeddings:
            body -= self.lm_head_parameters
        return max(0, body)

    def _attention_flops(self, query_context_pairs: float) -> float:
        # QKᵀ and AV: 2 FLOPs each per (query token, context token) pair, per query width, per layer.
        width = self.attention_width or self.hidden_size
        return 4.0 * self.num_layers * width * query_context_pairs

    def decode_flops(self, tokens: float, context_tokens: float = 0) -> float:
        """FLOPs on each device of decoding `tokens` tokens whose sequences hold `context_tokens` in all."""
        per_token = 2.0 * (self._matmul_parameters_per_token + self.lm_head_parameters)
        return (tokens * per_token + self._attention_flops(context_tokens)) / self.devices

    def prefill_flops(self, tokens: float, requests: int = 1, context_tokens: float = 0) -> float:
        """FLOPs on each device of prefilling `tokens` prompt tokens of `requests` requests.

        Each request's chunk is taken as an equal share that attends to itself (about n²/2
        pairs) and to `context_tokens` ÷ requests earlier tokens; the LM head runs once per request.
        """
        if tokens <= 0:
            return 0.0
        requests = max(1, requests)
        chunk = tokens / requests
        pairs = requests * (chunk * chunk / 2.0) + tokens * (context_tokens / requests)
        flops = 2.0 * self._matmul_parameters_per_token * tokens + 2.0 * self.lm_head_parameters * requests
        return (flops + self._attention_flops(pairs)) / self.devices

    def flops_per_token(self, context_length: int = 0) -> float:
        """FLOPs on each device of one decode token at `context_length`."""
        return self.decode_flops(1, context_length)


def model_cost_from_numbers(parameter_count: int, dtype: str) -> ModelCost:
    """Cost of a model known only by its size: no KV-cache or attention terms."""
    return ModelCost(
        parameter_count=parameter_count,
        bytes_per_parameter=dtype_bytes(dtype),
        num_layers=0,
        num_kv_heads=0,
        head_dim=0,
        hidden_size=0,
        kv_bytes_per_element=dtype_bytes(dtype),
    )


def resolve_model_path(text: str | Path) -> Path:
    """A local folder or config.json, or a Hugging Face hub id resolved to its local snapshot.

    Nothing is downloaded: a hub id that is not in the local cache is an error.
    """
    path = Path(text)
    if path.exists():
        return path
    name = str(text)
    if re.fullmatch(r"[\w.-]+/[\w.-]+", name):
        try:
            from huggingface_hub import snapshot_download
        except ImportError:
            raise ValueError(f"{name} is not a path, and without huggingface_hub no hub id can be resolved") from None
        try:
            return Path(snapshot_download(repo_id=name, local_files_only=True))
        except Exception:
            raise ValueError(
                f"{name} is neither a path nor a hub id in the local Hugging Face cache (nothing is downloaded)"
            ) from None
    raise ValueError(f"no model at {name} (give a Hugging Face model folder, its config.json, or a cached hub id)")


def model_cost_from_folder(
    folder: str | Path,
    dtype: str | None = None,
    parameter_count: int | None = None,
    kv_cache_dtype: str | None = None,
) -> ModelCost:
    """Cost of a Hugging Face model folder, a bare `config.json` or a cached hub id.

    Parameters: given, else counted from an unquantised checkpoint, else derived from the config.
    """
    path = resolve_model_path(folder)
    config_path = path / "config.json" if path.is_dir() else path
    if not config_path.is_file():
        raise ValueError(f"no model config at {config_path} (give a Hugging Face model folder or its config.json)")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{config_path} is not JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{config_path} holds no JSON object")
    checkpoint = read_checkpoint(config_path.parent)
    served = dtype or str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    return model_cost_from_config(config, parameter_count, served, kv_cache_dtype, checkpoint)


def _language_config(config: Mapping[str, object]) -> dict[str, object]:
    # Multimodal and newer configs (Gemma 3, Llama 4, Mistral 3) nest the language model's
    # shape under `text_config`: its fields win over the top level's.
    nested = config.get("text_config")
    merged = dict(config)
    if isinstance(nested, Mapping):
        merged.update(nested)
    return merged


def _integer(config: Mapping[str, object], *names: str) -> int | None:
    for name in names:
        value = config.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


@dataclass(frozen=True, slots=True)
class ModelShape:
    """A decoder's dimensions, as its config gives them."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    model_type: str
    tied: bool
    intermediate: int
    """The dense MLP's width."""


def model_shape(config: Mapping[str, object]) -> ModelShape:
    """The dimensions of a Hugging Face config (a multimodal one's language model); ValueError naming what it
    lacks."""
    return _shape(_language_config(config))


def _shape(config: Mapping[str, object]) -> ModelShape:
    required = {
        "num_hidden_layers": _integer(config, "num_hidden_layers", "n_layer", "num_layers"),
        "hidden_size": _integer(config, "hidden_size", "n_embd", "d_model"),
        "num_attention_heads": _integer(config, "num_attention_heads", "n_head"),
    }
    missing = [name for name, value in required.items() if value is None]
    if missing:
        raise ValueError(f"the model config lacks {', '.join(missing)} (looked at the top level and text_config)")
    layers, hidden, heads = (value or 0 for value in required.values())
    return ModelShape(
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=_integer(config, "num_key_value_heads", "num_kv_heads") or heads,
        head_dim=_integer(config, "head_dim") or hidden // heads,
        vocab=_integer(config, "vocab_size") or 0,
        model_type=str(config.get("model_type") or ""),
        tied=bool(config.get("tie_word_embeddings", True)),
        intermediate=_integer(config, "intermediate_size_mlp", "intermediate_size", "n_inner", "ffn_dim") or 4 * hidden,
    )


def _moe_layers(config: Mapping[str, object], layers: int) -> list[bool]:
    """Which layers' MLPs are mixtures of experts (the conventions vLLM's parsers know)."""
    first_dense = _integer(config, "first_k_dense_replace")
    frequency = _integer(config, "moe_layer_freq")
    if first_dense is not None:  # DeepSeek V2/V3
        step = frequency or 1
        return [layer >= first_dense and layer % step == 0 for layer in range(layers)]
    interleave = _integer(config, "interleave_moe_layer_step")
    if interleave:  # Llama 4
        return [(layer + 1) % interleave == 0 for layer in range(layers)]
    sparse_step = _integer(config, "decoder_sparse_step")
    mlp_only = config.get("mlp_only_layers")
    dense_layers = set(mlp_only) if isinstance(mlp_only, list) else set()
    if sparse_step:  # Qwen2-MoE / Qwen3-MoE
        return [layer not in dense_layers and (layer + 1) % sparse_step == 0 for layer in range(layers)]
    return [layer not in dense_layers for layer in range(layers)]


@dataclass(frozen=True, slots=True)
class ParameterCount:
    """A decoder's parameters derived from its config."""

    total: int
    embedding: int
    lm_head: int
    experts: RoutedExperts | None
    kv_latent_width: int
    attention_width: int
    quantisable: int
    """Parameters in the decoder layers' linear projections (what a quantised checkpoint packs)."""


def parameters_from_config(config: Mapping[str, object]) -> ParameterCount:
    """Parameters of a decoder-only transformer from its Hugging Face config.

    Embeddings (+ an untied LM head), per layer the attention projections (grouped-query,
    or DeepSeek's latent attention), the MLP (gated unless the architecture has none) or
    a mixture of experts (routed experts, router, shared experts), norms and QKV biases.
    Exact for Llama, Mistral, Mixtral, Qwen2/3 and Qwen3-MoE checkpoints; norms of other
    families may differ by a few thousand parameters.
    """
    config = _language_config(config)
    s = _shape(config)
    if not s.vocab:
        raise ValueError("the model config lacks vocab_size, needed to count its parameters")
    hidden, intermediate = s.hidden, s.intermediate
    matrices = 2 if s.model_type in _UNGATED_MLP else 3

    # Attention.
    kv_latent = _integer(config, "kv_lora_rank")
    if kv_latent:  # DeepSeek multi-head latent attention
        rope = _integer(config, "qk_rope_head_dim") or 0
        nope = _integer(config, "qk_nope_head_dim") or 0
        value_dim = _integer(config, "v_head_dim") or nope
        q_rank = _integer(config, "q_lora_rank")
        query_width = s.heads * (nope + rope)
        query = hidden * q_rank + q_rank + q_rank * query_width if q_rank else hidden * query_width
        keys_values = hidden * (kv_latent + rope) + kv_latent + kv_latent * s.heads * (nope + value_dim)
        attention = query + keys_values + s.heads * value_dim * hidden
        latent_width, attention_width = kv_latent + rope, query_width
    else:
        query_width, kv_width = s.heads * s.head_dim, s.kv_heads * s.head_dim
        attention = hidden * query_width + 2 * hidden * kv_width + query_width * hidden
        if s.model_type in _QKV_BIAS or config.get("attention_bias") is True:
            attention += query_width + 2 * kv_width
        latent_width, attention_width = 0, query_width
    norms = (4 if s.model_type in _FOUR_NORMS else 2) * hidden
    if s.model_type in _QK_NORM:
        norms += 2 * s.head_dim

    # MLP or mixture of experts.
    expert_count = _integer(config, "num_local_experts", "num_experts", "n_routed_experts") or 0
    experts: RoutedExperts | None = None
    moe_flags = [False] * s.layers
    routed_per_layer = moe_extra = 0
    if expert_count:
        per_token = _integer(config, "num_experts_per_tok", "moe_topk", "num_selected_experts")
        if not per_token:
            raise ValueError("the model config has experts but lacks num_experts_per_tok")
        expert_intermediate = _integer(config, "moe_intermediate_size", "intermediate_size") or intermediate
        per_expert = matrices * hidden * expert_intermediate
        moe_flags = _moe_layers(config, s.layers)
        routed_per_layer = expert_count * per_expert
        # The router, and shared experts every token goes through.
        moe_extra = hidden * expert_count
        shared = _integer(config, "n_shared_experts", "num_shared_experts")
        shared_intermediate = _integer(config, "shared_expert_intermediate_size")
        if shared:  # DeepSeek: n shared experts of the routed experts' size
            moe_extra += shared * per_expert
        elif shared_intermediate:  # Qwen2-MoE: one shared expert of its own size, with a gate
            moe_extra += matrices * hidden * shared_intermediate + hidden
        elif s.model_type.startswith("llama4"):  # Llama 4: one shared expert of the experts' size
            moe_extra += per_expert
        if s.model_type.startswith("deepseek_v3"):
            moe_extra += expert_count  # the router's score-correction bias
        experts = RoutedExperts(expert_count, per_token, sum(moe_flags), per_expert)
    dense_mlp = matrices * hidden * intermediate
    layers_total = sum(
        attention + norms + (routed_per_layer + moe_extra if is_moe else dense_mlp) for is_moe in moe_flags
    )
    embedding = s.vocab * hidden
    total = embedding + (0 if s.tied else embedding) + layers_total + hidden  # + the final norm
    linear = sum(attention + (routed_per_layer + moe_extra if is_moe else dense_mlp) for is_moe in moe_flags)
    return ParameterCount(total, embedding, embedding, experts, latent_width, attention_width, linear)


def _quantised_bytes_per_weight(quantization: Mapping[str, object]) -> float:
    """Stored bytes per quantised weight, scales and zero points included; ValueError if unknown."""
    method = str(quantization.get("quant_method") or "").lower()
    if method in {"fp8", "fbgemm_fp8", "ptpc_fp8"}:
        block = quantization.get("weight_block_size")
        if isinstance(block, list) and len(block) == 2:
            # One float32 scale per block of weights (DeepSeek V3's 128 × 128).
            return 1.0 + 4.0 / (int(block[0]) * int(block[1]))
        return 1.0  # per-tensor or per-channel scales: negligible
    if method in {"awq", "gptq", "awq_marlin", "gptq_marlin"}:
        bits = _integer(quantization, "bits", "w_bit") or 4
        group = _integer(quantization, "group_size", "q_group_size") or 128
        if group <= 0:  # per channel
            return bits / 8
        # Packed weights + per group one fp16 scale and one packed zero point.
        return bits / 8 + (2.0 + bits / 8) / group
    if method == "compressed-tensors":
        groups = quantization.get("config_groups")
        if isinstance(groups, Mapping):
            for group_config in groups.values():
                weights = group_config.get("weights") if isinstance(group_config, Mapping) else None
                if isinstance(weights, Mapping):
                    bits = _integer(weights, "num_bits") or 8
                    group_size = _integer(weights, "group_size")
                    zero = 0.0 if weights.get("symmetric", True) else bits / 8
                    scale = (2.0 + zero) / group_size if group_size and group_size > 0 else 0.0
                    return bits / 8 + scale
    raise ValueError(f"unsupported quantization method {method or '(none named)'!r}: cannot size its weights")


def model_cost_from_config(
    config: Mapping[str, object],
    parameter_count: int | None,
    dtype: str,
    kv_cache_dtype: str | None = None,
    checkpoint: CheckpointSize | None = None,
) -> ModelCost:
    """Cost of a model described by a Hugging Face `config.json` (as a mapping).

    `parameter_count` None: counted from an unquantised `checkpoint`, else derived from
    the config. Weight bytes of a quantised model come from the checkpoint's stored bytes,
    else from its `quantization_config`. ValueError names what is missing.
    """
    language = _language_config(config)
    s = _shape(language)
    element = dtype_bytes(dtype)
    quantization = language.get("quantization_config")
    quantised = isinstance(quantization, Mapping)
    try:
        derived: ParameterCount | None = parameters_from_config(language)
    except ValueError:
        derived = None
    if parameter_count is None:
        if checkpoint is not None and not quantised:
            parameter_count = checkpoint.elements
        elif derived is not None:
            parameter_count = derived.total
        else:
            raise ValueError(
                "no parameter count: no unquantised safetensors checkpoint, and the config lacks vocab_size "
                "(give the parameter count)"
            )
    bytes_per_parameter: float = element
    if quantised:
        assert isinstance(quantization, Mapping)
        if checkpoint is not None:
            bytes_per_parameter = checkpoint.stored_bytes / parameter_count
        elif derived is not None:
            per_weight = _quantised_bytes_per_weight(quantization)
            # What is not quantised (embeddings, LM head, norms) is stored in the checkpoint's own dtype.
            rest = dtype_bytes(str(language.get("torch_dtype") or language.get("dtype") or "bfloat16"))
            stored = derived.quantisable * per_weight + (derived.total - derived.quantisable) * rest
            bytes_per_parameter = stored / parameter_count
        else:
            raise ValueError("a quantised model without a checkpoint needs vocab_size in its config to size it")
    # vLLM's KV cache takes the served dtype ("auto"), but stays 16-bit for 8-bit weights
    # unless --kv-cache-dtype says otherwise.
    kv_element = max(element, 2)
    if kv_cache_dtype and kv_cache_dtype != "auto":
        kv_element = dtype_bytes(kv_cache_dtype)
    return ModelCost(
        parameter_count=parameter_count,
        bytes_per_parameter=bytes_per_parameter,
        num_layers=s.layers,
        num_kv_heads=s.kv_heads,
        head_dim=s.head_dim,
        hidden_size=s.hidden,
        kv_bytes_per_element=kv_element,
        attention_width=derived.attention_width if derived else s.heads * s.head_dim,
        embedding_parameters=derived.embedding if derived else 0,
        lm_head_parameters=derived.lm_head if derived else 0,
        tied_embeddings=s.tied,
        experts=derived.experts if derived else None,
        kv_latent_width=derived.kv_latent_width if derived else 0,
    )
