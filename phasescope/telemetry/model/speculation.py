"""Speculative decoding in the calculator: what drafting k tokens and verifying them in one step can reach.

A drafter proposes k tokens per sequence; the target model verifies them in one forward pass over
k + 1 positions (the k drafts and the token after the last accepted one), streaming its weights once
for all of them. While the step is memory-bound the extra positions are nearly free, so a sequence
emits more than one token per weight read; once B × (k + 1) tokens reach the compute roof they are
not, and plain decode wins again.

The drafter proposes its k tokens in k sequential draft steps, one token per sequence each, before
the verify step; a round lasts the verify step + k draft steps (`Drafter`). A free drafter (an
n-gram or prompt-lookup drafter, the default) gives the upper bound; a draft model's step is its own
decode step on the same device, and a draft cost c is a fixed share of the target's decode step, as
in Leviathan et al. (2023), where the speedup of a memory-bound verify step is E ÷ (1 + k × c).
Acceptance is taken to be independent at each position with the same rate, as there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from phasescope.telemetry.hardware.peaks import HardwarePeaks
from phasescope.telemetry.model.cost import ModelCost

MAX_SPECULATIVE_TOKENS = 16
"""The largest k searched for the best number of drafted tokens."""
BEST_TOKENS_BATCH_SIZE = 1
"""The batch at which the best k is chosen: a single sequence, where speculation pays most."""


def expected_tokens_per_step(acceptance_rate: float, speculative_tokens: int) -> float:
    """Tokens a sequence emits per verify step, on average, with `speculative_tokens` drafted per step.

    ValueError when k < 1 or the acceptance rate is outside [0, 1).
    """
    if speculative_tokens < 1:
        raise ValueError(f"speculative_tokens must be at least 1, got {speculative_tokens}")
    if not 0 <= acceptance_rate < 1:
        raise ValueError(f"acceptance_rate must be in [0, 1), got {acceptance_rate}")
    # Draft i (1-based) is kept only if drafts 1..i all are: probability aⁱ. The step emits the kept
    # drafts and one token of its own (the correction, or the bonus token after k kept drafts), so
    # E = 1 + a + a² + … + aᵏ = (1 − a^(k+1)) ÷ (1 − a)  (Leviathan et al. 2023, i.i.d. acceptance).
    return (1.0 - acceptance_rate ** (speculative_tokens + 1)) / (1.0 - acceptance_rate)


@dataclass(frozen=True, slots=True)
class VerifyStep:
    """One verify step of a batch: k + 1 positions of every sequence through one read of the weights."""

    batch_size: int
    speculative_tokens: int
    bytes_per_step: float
    flops_per_step: float
    step_seconds: float
    achieved_flops_per_second: float
    arithmetic_intensity_flops_per_byte: float
    bound: str
    """"memory" or "compute": which roof the step hits."""


def verify_step(
    cost: ModelCost,
    peaks: HardwarePeaks,
    dtype: str,
    batch_size: int,
    context_length: int,
    speculative_tokens: int,
) -> VerifyStep:
    """The verify step of `batch_size` sequences at `context_length`, each with `speculative_tokens` drafts.

    With no drafts (k = 0) it is the plain decode step, figure for figure (`roofline.decode_step`).
    """
    positions = speculative_tokens + 1
    tokens = batch_size * positions
    bandwidth = peaks.memory_bandwidth_bytes_per_second
    peak_flops = peaks.peak_flops(dtype)
    # Bytes: the weights B × (k + 1) tokens touch, read once for all of them, + each sequence's KV
    # cache, read once per step: the k + 1 query positions of a sequence share the attention
    # kernel's tiles, as a prefill chunk's do.
    bytes_per_step = cost.weights_read(tokens) + batch_size * context_length * cost.device_kv_cache_bytes_per_token
    # FLOPs: B × (k + 1) tokens through the weights and the LM head (every position's logits are
    # checked), and position i = 0..k attends to its context + the i drafts before it:
    # Σᵢ (c + i) = (k + 1) × c + k × (k + 1) ÷ 2 pairs per sequence.
    pairs = batch_size * (positions * context_length + speculative_tokens * positions / 2)
    flops_per_step = cost.decode_flops(tokens, pairs)
    memory_seconds = bytes_per_step / bandwidth
    compute_seconds = flops_per_step / peak_flops
    step_seconds = max(memory_seconds, compute_seconds)
    return VerifyStep(
        batch_size=batch_size,
        speculative_tokens=speculative_tokens,
        bytes_per_step=bytes_per_step,
        flops_per_step=flops_per_step,
        step_seconds=step_seconds,
        achieved_flops_per_second=flops_per_step / step_seconds,
        arithmetic_intensity_flops_per_byte=flops_per_step / bytes_per_step,
        bound="memory" if memory_seconds >= compute_seconds else "compute",
    )


@dataclass(frozen=True, slots=True)
class Drafter:
    """What one draft step costs: every sequence of the batch drafting one token.

    Free by default (an n-gram or prompt-lookup drafter: the upper bound). `model`: a draft model,
    run on the same device at the same batch and context (its own weights read every step, its own
    KV cache). `cost_ratio`: the draft step as a fixed share c of the target's plain decode step at
    the same batch (Leviathan et al. 2023). One or the other, not both.
    """

    model: ModelCost | None = None
    cost_ratio: float = 0.0
    name: str | None = None
    """The draft model's folder or hub id, as given (for the report)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.cost_ratio) and self.cost_ratio >= 0):
            raise ValueError(f"the draft cost ratio must be a finite number ≥ 0, got {self.cost_ratio}")
        if self.model is not None and self.cost_ratio > 0:
            raise ValueError("a drafter is a draft model or a draft cost ratio, not both")

    @property
    def free(self) -> bool:
        return self.model is None and self.cost_ratio == 0


FREE_DRAFTER = Drafter()
"""No draft cost: the upper bound."""


def draft_step_seconds(
    cost: ModelCost, peaks: HardwarePeaks, dtype: str, batch_size: int, context_length: int, drafter: Drafter
) -> float:
    """One draft step of `batch_size` sequences at `context_length`: one token each from the drafter.

    A draft model's step is its plain decode step on the same roofline (its k = 0 verify step); a
    cost ratio c is c × the target's (`cost`) plain decode step at the same batch; free is 0.
    """
    if drafter.model is not None:
        return verify_step(drafter.model, peaks, dtype, batch_size, context_length, 0).step_seconds
    if drafter.cost_ratio > 0:
        return drafter.cost_ratio * verify_step(cost, peaks, dtype, batch_size, context_length, 0).step_seconds
    return 0.0


def draft_cost_ratio(
    cost: ModelCost, peaks: HardwarePeaks, dtype: str, batch_size: int, context_length: int, drafter: Drafter
) -> float:
    """The draft step ÷ the target's plain decode step at one batch: Leviathan et al.'s c."""
    if drafter.model is None:
        return drafter.cost_ratio
    plain = verify_step(cost, peaks, dtype, batch_size, context_length, 0).step_seconds
    return draft_step_seconds(cost, peaks, dtype, batch_size, context_length, drafter) / plain


def _round(
    cost: ModelCost,
    peaks: HardwarePeaks,
    dtype: str,
    batch_size: int,
    context_length: int,
    speculative_tokens: int,
    drafter: Drafter,
) -> tuple[VerifyStep, float]:
    """One speculative round: the verify step, and the k draft steps' seconds before it."""
    step = verify_step(cost, peaks, dtype, batch_size, context_length, speculative_tokens)
    drafting = speculative_tokens * draft_step_seconds(cost, peaks, dtype, batch_size, context_length, drafter)
    return step, drafting


def speculative_speedup(
    cost: ModelCost,
    peaks: HardwarePeaks,
    dtype: str,
    batch_size: int,
    context_length: int,
    speculative_tokens: int,
    acceptance_rate: float,
    drafter: Drafter = FREE_DRAFTER,
) -> float:
    """Per-sequence emitted tok/s with speculation ÷ plain decode's tok/s, at one batch size."""
    # Emitted tok/s per sequence = E ÷ (verify step + k draft steps); plain = 1 ÷ decode step (the
    # k = 0 verify step). A memory-bound verify step lasts the decode step, so with c: E ÷ (1 + k × c).
    emitted = expected_tokens_per_step(acceptance_rate, speculative_tokens)
    plain_seconds = verify_step(cost, peaks, dtype, batch_size, context_length, 0).step_seconds
    step, drafting = _round(cost, peaks, dtype, batch_size, context_length, speculative_tokens, drafter)
    return emitted * plain_seconds / (step.step_seconds + drafting)


def best_speculative_tokens(
    cost: ModelCost,
    peaks: HardwarePeaks,
    dtype: str,
    context_length: int,
    acceptance_rate: float,
    drafter: Drafter = FREE_DRAFTER,
) -> int:
    """The k in 1..MAX_SPECULATIVE_TOKENS with the most emitted tok/s per sequence at BEST_TOKENS_BATCH_SIZE.

    The smallest such k on a tie. With a free drafter, while the verify step stays memory-bound its
    time barely moves with k and E grows with every k, so the answer is the largest k before the
    compute roof (or the bound of the search). A costly drafter adds k draft steps to every round
    while E saturates at 1 ÷ (1 − a): the best k is interior (c = 0.05, a = 0.7, memory-bound: k = 6,
    E ÷ (1 + k × c) = 2.35294, k = 5 a hair behind).
    """
    best_tokens, best_rate = 1, 0.0
    for tokens in range(1, MAX_SPECULATIVE_TOKENS + 1):
        step, drafting = _round(cost, peaks, dtype, BEST_TOKENS_BATCH_SIZE, context_length, tokens, drafter)
        rate = expected_tokens_per_step(acceptance_rate, tokens) / (step.step_seconds + drafting)
        if rate > best_rate:
            best_tokens, best_rate = tokens, rate
    return best_tokens


def stops_helping_batch_size(
    cost: ModelCost,
    peaks: HardwarePeaks,
    dtype: str,
    context_length: int,
    speculative_tokens: int,
    acceptance_rate: float,
    max_batch_size: int,
    drafter: Drafter = FREE_DRAFTER,
) -> int | None:
    """The batch from which speculation's tok/s per sequence is no more than plain decode's at every batch
    up to `max_batch_size`; None when speculation still helps at `max_batch_size` (or there is none).

    For a dense model the speedup only falls as the batch grows, so this is the first batch where
    speculation does not help. A mixture of experts' drafts touch more experts than one token does:
    speculation can lose at batch 1 and win at batch 2 (Mixtral, tests/unit/telemetry/model/
    test_speculation.py), so every batch is tried, from the largest down.
    """
    if max_batch_size < 1:
        return None
    for batch in range(max_batch_size, 0, -1):
        speedup = speculative_speedup(
            cost, peaks, dtype, batch, context_length, speculative_tokens, acceptance_rate, drafter
        )
        if speedup > 1:
            return None if batch == max_batch_size else batch + 1
    return 1


@dataclass(frozen=True, slots=True)
class SpeculativeRow:
    """Speculation at one batch size, beside that batch's plain decode row."""

    batch_size: int
    speculative_step_seconds: float
    """The verify step: k + 1 positions per sequence."""
    speculative_draft_seconds: float
    """The k draft steps before it (0 for a free drafter)."""
    speculative_tokens_per_second_per_sequence: float
    """Emitted tokens: E ÷ (the verify step + the k draft steps)."""
    speculative_tokens_per_second_total: float
    speculative_achieved_flops_per_second: float
    speculative_arithmetic_intensity_flops_per_byte: float
    speculative_bound: str
    """"memory" or "compute": which roof the verify step hits."""
    speculative_speedup_ratio: float
    """Speculative tok/s per sequence ÷ plain decode's."""
    speculation_helps: bool
    """The speedup is above 1."""


@dataclass(frozen=True, slots=True)
class Speculation:
    """The calculator's answer for k drafted tokens at an acceptance rate, with a drafter's cost."""

    speculative_tokens: int
    acceptance_rate: float
    draft_cost_ratio: float
    """One draft step ÷ the target's decode step: the given c, or a draft model's at batch 1 (0: free)."""
    draft_model: str | None
    """The draft model's folder or hub id; None for a free drafter or a given c."""
    speculative_tokens_per_step: float
    """E = (1 − a^(k+1)) ÷ (1 − a): tokens a sequence emits per verify step."""
    best_speculative_tokens: int
    """The k in 1..MAX_SPECULATIVE_TOKENS with the most tok/s per sequence at `best_speculative_tokens_batch_size`."""
    best_speculative_tokens_batch_size: int
    best_speculative_tokens_per_step: float
    """E at the best k."""
    speculation_stops_helping_batch_size: int | None
    """The batch from which speculation no longer beats plain decode per sequence, at any batch up to the
    largest row's; None when it still does at the largest (`stops_helping_batch_size`)."""
    rows: tuple[SpeculativeRow, ...]


def speculation(
    cost: ModelCost,
    peaks: HardwarePeaks,
    dtype: str,
    batch_sizes: tuple[int, ...],
    context_length: int,
    speculative_tokens: int,
    acceptance_rate: float,
    drafter: Drafter = FREE_DRAFTER,
) -> Speculation:
    """Speculation's figures at each of `batch_sizes` (none: the weights do not fit), the best k and the
    batch where speculation stops helping, each round paying `drafter`'s k draft steps."""
    emitted = expected_tokens_per_step(acceptance_rate, speculative_tokens)
    rows = []
    for batch in batch_sizes:
        step, drafting = _round(cost, peaks, dtype, batch, context_length, speculative_tokens, drafter)
        round_seconds = step.step_seconds + drafting
        speedup = speculative_speedup(
            cost, peaks, dtype, batch, context_length, speculative_tokens, acceptance_rate, drafter
        )
        rows.append(
            SpeculativeRow(
                batch_size=batch,
                speculative_step_seconds=step.step_seconds,
                speculative_draft_seconds=drafting,
                speculative_tokens_per_second_per_sequence=emitted / round_seconds,
                speculative_tokens_per_second_total=batch * emitted / round_seconds,
                speculative_achieved_flops_per_second=step.achieved_flops_per_second,
                speculative_arithmetic_intensity_flops_per_byte=step.arithmetic_intensity_flops_per_byte,
                speculative_bound=step.bound,
                speculative_speedup_ratio=speedup,
                speculation_helps=speedup > 1,
            )
        )
    best = best_speculative_tokens(cost, peaks, dtype, context_length, acceptance_rate, drafter)
    return Speculation(
        speculative_tokens=speculative_tokens,
        acceptance_rate=acceptance_rate,
        draft_cost_ratio=draft_cost_ratio(cost, peaks, dtype, BEST_TOKENS_BATCH_SIZE, context_length, drafter),
        draft_model=drafter.name if drafter.model is not None else None,
        speculative_tokens_per_step=emitted,
        best_speculative_tokens=best,
        best_speculative_tokens_batch_size=BEST_TOKENS_BATCH_SIZE,
        best_speculative_tokens_per_step=expected_tokens_per_step(acceptance_rate, best),
        speculation_stops_helping_batch_size=stops_helping_batch_size(
            cost,
            peaks,
            dtype,
            context_length,
            speculative_tokens,
            acceptance_rate,
            max(batch_sizes, default=0),
            drafter,
        ),
        rows=tuple(rows),
    )
