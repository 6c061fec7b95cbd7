"""Speculative decoding, once: the drafter, a verify step's work and its drafts' accounting, for both the roofline
calculator and the live step attribution, and what drafting k tokens per sequence can reach.

**The rules both sides use.**
- A drafter (`Drafter`) proposes k tokens per sequence in k sequential draft steps, one token per sequence each,
  before the verify step. Host code (an n-gram, suffix or prompt-lookup drafter) does no device work: the
  calculator's upper bound. A draft model's draft step is its own plain decode step on the same device, at the
  same batch and context (`decode_work`): its weights read every step, its own KV cache.
- The target model verifies the drafts in one forward pass over k + 1 positions per sequence (the k drafts and
  the token after the last accepted one), streaming its weights once for all of them (`verify_work`). Whatever
  the number of positions it is a decode step: every position goes through the weights and the LM head (every
  position's logits are checked) and attends to its sequence's context; the weights the positions touch are
  read once, each sequence's KV cache once (the positions of a sequence share the attention kernel's tiles, as
  a prefill chunk's do), each position writes its new KV entries. With one position per sequence it is the
  plain decode step, the baseline speculation is judged against: speculation pays when the sequences emit more
  tokens per second of roofline time than that step would give them.

**The calculator** (`speculation`, the rows of `phasescope roofline --speculative-tokens`). While the verify
step is memory-bound the extra positions are nearly free, so a sequence emits more than one token per weight
read; once B × (k + 1) tokens reach the compute roof they are not, and plain decode wins again. Each draft is
accepted independently with the same rate a, and a sequence emits E = (1 − a^(k+1)) ÷ (1 − a) tokens per verify
step (`expected_tokens_per_step`); a round lasts the verify step + k draft steps. Besides a free drafter and a
draft model, a draft cost c is a draft step as a fixed share of the target's decode step, as in Leviathan et al.
(2023), where the speedup of a memory-bound verify step is E ÷ (1 + k × c). Position i = 0..k of a sequence
attends to its context and the i drafts before it (`verify_attention_pairs`), and the steps count the bytes
they read, as `roofline.decode_step` does.

**The step attribution** (`phasescope.telemetry.step.attribution`) counts what a verify step the engine ran
did. A step emits its positions less its rejected drafts (`emitted_tokens`); the emitted positions' share of
the verify FLOPs is useful, the rejected drafts' wasted (`useful_flops`). A draft model's k draft steps over
the sequences whose drafts the step verified are decode's work too, their bytes moved (read and written)
counted (`draft_work`); host code is none. The drafter's part of the step's measured time is its share of the
roofline time (`drafter_seconds`). The record carries the KV cache its decoding sequences hold, not each
position's context: every position attends to its sequence's whole context.
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


@dataclass(frozen=True, slots=True)
class Drafter:
    """What proposes the drafts a verify step checks, and what one of its draft steps costs.

    Host code by default (an n-gram, suffix or prompt-lookup drafter: no device work, the calculator's upper
    bound). `model`: a draft model, run on the same device at the same batch and context (its own weights read
    every draft step, its own KV cache). `cost_ratio`: a draft step as a fixed share c of the target's plain
    decode step at the same batch (Leviathan et al. 2023): the calculator's alone, a time with no FLOPs or bytes
    to attribute. A model or a ratio, not both.
    """

    tokens: int = 0
    """k: the drafts it proposes per sequence per verify step, as the engine is set (the step attribution's k);
    0 where k is not fixed: the calculator takes k as an argument and searches it for the best."""
    model: ModelCost | None = None
    """A draft model's cost (per device, split like the model it drafts for); None for host code or a ratio."""
    cost_ratio: float = 0.0
    name: str | None = None
    """The draft model's folder or hub id, as given (for the calculator's report)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.cost_ratio) and self.cost_ratio >= 0):
            raise ValueError(f"the draft cost ratio must be a finite number ≥ 0, got {self.cost_ratio}")
        if self.model is not None and self.cost_ratio > 0:
            raise ValueError("a drafter is a draft model or a draft cost ratio, not both")

    @property
    def free(self) -> bool:
        """No device work and no cost ratio: host code."""
        return self.model is None and self.cost_ratio == 0


FREE_DRAFTER = Drafter()
"""No draft cost: the upper bound."""


# The work of a verify step and of a draft step: the rules both sides use.


@dataclass(frozen=True, slots=True)
class DecodeWork:
    """One forward pass of decode positions, on each device (`verify_work`)."""

    flops: float
    read_bytes: float
    written_bytes: float

    @property
    def moved_bytes(self) -> float:
        return self.read_bytes + self.written_bytes


def verify_work(cost: ModelCost, positions: float, context_tokens: float, attention_pairs: float) -> DecodeWork:
    """One pass of `positions` decode positions whose sequences hold `context_tokens` tokens of KV cache in all,
    with `attention_pairs` (query position, context token) pairs of attention (module docstring).

    A verify step has k + 1 positions per sequence; a plain decode step or a draft step one (`decode_work`).
    """
    kv_bytes = cost.device_kv_cache_bytes_per_token
    return DecodeWork(
        flops=cost.decode_flops(positions, attention_pairs),
        read_bytes=cost.weights_read(positions) + context_tokens * kv_bytes,
        written_bytes=positions * kv_bytes,
    )


def decode_work(cost: ModelCost, sequences: float, context_tokens: float) -> DecodeWork:
    """One token for each of `sequences` sequences holding `context_tokens` in all: the plain decode step a
    verify step is judged against, or, with a draft model's own `cost`, one of its draft steps."""
    return verify_work(cost, sequences, context_tokens, context_tokens)


def verify_attention_pairs(sequences: int, context_length: int, speculative_tokens: int) -> float:
    """The calculator's attention pairs of a verify step: `sequences` sequences at `context_length`, position
    i = 0..k of each attending to its context and the i drafts before it."""
    positions = speculative_tokens + 1
    # Σᵢ (c + i) = (k + 1) × c + k × (k + 1) ÷ 2 pairs per sequence.
    return sequences * (positions * context_length + speculative_tokens * positions / 2)


# What a verify step the engine ran did: the step attribution's figures.


def emitted_tokens(positions: int, rejected_tokens: int) -> int:
    """Tokens a verify step emits: its positions less its rejected drafts (the engine's generation tokens)."""
    return max(0, positions - rejected_tokens)


def useful_flops(verify_flops: float, positions: int, emitted: int) -> float:
    """The emitted positions' share of a verify step's FLOPs; the rest, the rejected drafts', is wasted."""
    return verify_flops * emitted / positions if positions else 0.0


def draft_work(drafter: Drafter, sequences: int, context_tokens: float) -> tuple[float, float]:
    """(FLOPs, bytes moved) on each device of the drafter's k draft steps for `sequences` sequences holding
    `context_tokens` in all: k draft-model decode steps, each reading its weights and its KV at their context and
    writing its new KV; nothing for host code."""
    if drafter.model is None or not sequences:
        return 0.0, 0.0
    step = decode_work(drafter.model, sequences, context_tokens)
    return drafter.tokens * step.flops, drafter.tokens * step.moved_bytes


def drafter_seconds(measured_seconds: float, verify_roofline_seconds: float, drafter_roofline_seconds: float) -> float:
    """The drafter's part of a verify step's `measured_seconds` of decode: its share of the roofline time."""
    roofline_seconds = verify_roofline_seconds + drafter_roofline_seconds
    return measured_seconds * drafter_roofline_seconds / roofline_seconds if roofline_seconds else 0.0


# The calculator: what k drafted tokens at an acceptance rate can reach.


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
    tokens = batch_size * (speculative_tokens + 1)
    bandwidth = peaks.memory_bandwidth_bytes_per_second
    peak_flops = peaks.peak_flops(dtype)
    pairs = verify_attention_pairs(batch_size, context_length, speculative_tokens)
    work = verify_work(cost, tokens, batch_size * context_length, pairs)
    # The bytes it reads, as `roofline.decode_step` counts them: its new KV entries are left out.
    bytes_per_step = work.read_bytes
    flops_per_step = work.flops
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
