"""The request as the engine is asked for it, whichever protocol it came in by.

Each protocol handler parses its own messages into these values (`phasescope.serve.v1_requests`
for phasescope.v1, `phasescope.serve.engine_protocol.requests` for vLLM's engine protocol); the request
lifecycle and the engine see only these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True, slots=True)
class ModelLimits:
    max_model_len: int
    vocab_size: int
    max_chars_per_token: int
    """The longest token in the vocabulary, in characters: text longer than this many
    characters per token of context cannot fit, whatever it says."""
    max_logprobs: int = 20
    """The most alternatives per token the engine returns log probabilities for (vLLM's max_logprobs)."""


@dataclass(frozen=True, slots=True)
class ChatTurn:
    role: str
    content: str


@dataclass(frozen=True, slots=True)
class ParsedInput:
    """What the client asked the model to continue; exactly one of the three is set."""

    kind: Literal["prompt", "chat", "token_ids"]
    prompt: str = ""
    chat: tuple[ChatTurn, ...] = ()
    token_ids: tuple[int, ...] = ()


StructuredKind = Literal["json_schema", "json_object", "regex", "grammar", "choice", "structural_tag"]


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A constraint on the output's text (vLLM's structured outputs, compiled by its grammar backend)."""

    kind: StructuredKind
    value: str = ""
    """The JSON schema, regex, EBNF grammar or structural tag, as text (empty for json_object and choice)."""
    choices: tuple[str, ...] = ()
    """For `choice`: the output is exactly one of these."""
    field: str = ""
    """The request's field that asked for it, as its protocol spells it: what a refusal by the
    engine's grammar compiler names."""


@dataclass(frozen=True, slots=True)
class KvTransfer:
    """A request's KV-transfer parameters (disaggregated prefill and decode): opaque to phasescope, handed to the
    engine's KV connector as they came (vLLM's `SamplingParams.extra_args["kv_transfer_params"]`)."""

    params: dict[str, Any]
    """The connector's parameters, a JSON object (never empty: an empty one asks for nothing)."""
    field: str
    """The request's field that carried them, as its protocol spells it: what a refusal names."""


@dataclass(frozen=True, slots=True)
class SamplingSpec:
    """Validated sampling values; None means "the model's default"."""

    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    detokenize: bool = True
    """False: the engine produces token ids only (GenerateRequest.token_ids_only); every text is empty."""
    stream_interval: int | None = None
    """Tokens per streamed chunk (GenerateRequest.stream_interval); None: the server's."""
    min_tokens: int = 0
    """No end-of-sequence or stop token ends the output before this many tokens."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias added to its logit) pairs, each bias in [-100, 100]."""
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured: StructuredOutput | None = None
    logprobs: int | None = None
    """Log probabilities of each output token and of this many alternatives (0: the sampled token's
    only); None: none."""
    prompt_logprobs: int | None = None
    """The same for each prompt token after the first; None: none."""
    bad_words: tuple[str, ...] = ()
    """Words the output never contains (vLLM bans each one's tokens, with and without a leading space)."""
    n: int = 1
    """Samples drawn for the one prompt, each its own sequence in the engine (sample i's seed is `seed` + i)."""
    kv_transfer: KvTransfer | None = None
    """What the engine's KV connector is asked to do for this request (None: a request served on its own)."""
