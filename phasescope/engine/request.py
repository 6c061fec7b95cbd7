"""The request as the engine is asked for it, whichever protocol it came in by.

Each protocol handler parses its own messages into these values (`phasescope.serve.validation`
for phasescope.v1); the request lifecycle and the engine see only these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True)
class ModelLimits:
    max_model_len: int
    vocab_size: int
    max_chars_per_token: int
    """The longest token in the vocabulary, in characters: text longer than this many
    characters per token of context cannot fit, whatever it says."""


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
