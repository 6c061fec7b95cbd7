"""The text around a request path that carries token ids only: smg's Rust server behind phasescope.v1.

smg's Rust server (`--front-end rust`) takes token ids and returns token ids; the smg gateway in front of it
tokenises and detokenises. phasescope.v1 takes text and chats and returns text, so the phasescope.v1 port that
serves beside the Rust server (`phasescope.serve.rust_mode`) does that part here, with vLLM's own pieces: the
model's tokenizer and chat template, vLLM's sampling rules (a request the engine would refuse is refused before
it is sent, naming its field), and vLLM's incremental detokenizer with its stop-string handling. The Rust server
matches stop strings itself and ends the request there; the detokenizer cuts the text at the same place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from phasescope.engine.base import EngineOptions, ModelDescription
from phasescope.engine.request import ModelLimits, ParsedInput, SamplingSpec
from phasescope.engine.vllm.engine import describe, engine_arguments, engine_config, sampling_params, tokenize_input
from phasescope.errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class _Request:
    """What vLLM's incremental detokenizer reads of an engine request."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: Any


class Detokenizer:
    """One sample's output text, step by step, cut at a stop string as vLLM's front end cuts it."""

    def __init__(self, detokenizer: Any, stop_token_ids: frozenset[int], min_tokens: int) -> None:
        self._detokenizer = detokenizer
        self._stop_token_ids = stop_token_ids
        self._min_tokens = min_tokens
        self._tokens = 0

    def text(self, token_ids: tuple[int, ...], finished: bool = False) -> str:
        """The text these new tokens add (held back while it may still become a stop string, all of it once
        `finished`). A last token that is a stop token (end of sequence, a stop token id) adds none, as in vLLM."""
        self._tokens += len(token_ids)
        stop_terminated = bool(token_ids) and token_ids[-1] in self._stop_token_ids and self._tokens > self._min_tokens
        if self._detokenizer.update(list(token_ids), stop_terminated) is not None:
            finished = True
        text: str = self._detokenizer.get_next_output_text(finished, delta=True)
        return text


class TextSide:
    """The model's tokenizer, sampling rules and detokenizer, for a front end whose engine speaks token ids."""

    def __init__(self, vllm_config: Any, tokenizer: Any, model_path: str, served_model_name: str) -> None:
        self._vllm_config = vllm_config
        self._tokenizer = tokenizer
        self._model_path = model_path
        self._served_model_name = served_model_name
        model_config = vllm_config.model_config
        self._defaults: dict[str, Any] = dict(model_config.get_diff_sampling_param() or {})
        self.limits = ModelLimits(
            max_model_len=model_config.max_model_len,
            vocab_size=model_config.get_vocab_size(),
            max_chars_per_token=int(tokenizer.max_chars_per_token),
            max_logprobs=int(getattr(model_config, "max_logprobs", 20)),
        )
        # The ids that end a sequence: the model's and its generation config's (as vLLM's engine stops on them).
        eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        generation_eos = (model_config.try_get_generation_config() or {}).get("eos_token_id")
        if isinstance(generation_eos, int):
            eos.add(generation_eos)
        elif isinstance(generation_eos, list | tuple):
            eos.update(int(token) for token in generation_eos)
        self.eos_token_ids = frozenset(eos)

    @classmethod
    def load(cls, options: EngineOptions, model_path: str, served_model_name: str) -> TextSide:
        """The text side of the engine these options start (reads the model's configs and tokenizer: off the
        event loop)."""
        from vllm.tokenizers import cached_tokenizer_from_config

        engine_args, _ = engine_arguments(options, model_path, served_model_name)
        vllm_config = engine_config(engine_args)
        return cls(vllm_config, cached_tokenizer_from_config(vllm_config.model_config), model_path, served_model_name)

    def description(self) -> ModelDescription:
        """The model and engine as vLLM's configuration says (the KV cache's size is the engine cores' to say)."""
        return describe(self._vllm_config, self._model_path, self._served_model_name)

    def tokenize(self, parsed: ParsedInput) -> list[int]:
        return tokenize_input(self._tokenizer, parsed)

    def check(self, spec: SamplingSpec) -> Any:
        """Refuse what vLLM's front end refuses (an `InvalidRequestError` naming the field) before it is sent: its
        sampling rules, and what it checks against the model (log probabilities, logit bias and stop token ids
        within the vocabulary, a structured output its grammar backend compiles). The Rust server hands some values
        to the engine core unchecked. Returns vLLM's `SamplingParams` for the spec (what `detokenizer` reads)."""
        from vllm.exceptions import VLLMClientError

        params = sampling_params(spec, self._defaults)
        config = self._vllm_config
        try:
            params.verify(
                config.model_config, config.speculative_config, config.structured_outputs_config, self._tokenizer
            )
        except (ValueError, VLLMClientError) as exc:
            parameter = getattr(exc, "parameter", None)
            if parameter is None and spec.structured is not None:
                raise InvalidRequestError(spec.structured.field or "sampling", str(exc)) from exc
            raise InvalidRequestError(f"sampling.{parameter}" if parameter else "sampling", str(exc)) from exc
        return params

    def detokenizer(self, request_id: str, prompt_token_ids: list[int], spec: SamplingSpec, params: Any) -> Detokenizer:
        """A sample's detokenizer, primed with its prompt; `params` are what `check` returned for the spec."""
        from vllm.v1.engine.detokenizer import IncrementalDetokenizer

        request = _Request(request_id, prompt_token_ids, params)
        stop_ids = set(spec.stop_token_ids) | (set() if spec.ignore_eos else set(self.eos_token_ids))
        return Detokenizer(
            IncrementalDetokenizer.from_new_request(self._tokenizer, request),  # type: ignore[arg-type]  # a duck
            frozenset(stop_ids),
            spec.min_tokens,
        )
