"""Each engine step's work, attributed to the phases (pure).

Each step is classified (prefill-only, decode-only or mixed, `records.StepRecord.kind`) and its
FLOPs, bytes and time are charged to the phases (`attribute_step`).

**The phase split (written once, here and in docs/metrics.md).** A pure step
belongs wholly to its phase. In a mixed step (chunked prefill: new prompts'
chunks scheduled beside running decodes) each phase is charged its marginal
cost, so that neither phase's operating point is contaminated by the other's:
- FLOPs: decode pays what a decode-only step of its batch does by the cost
  model (≈ 2 × active parameters per token, the LM head for each, attention
  over its sequences' context), at most the step's total; the prefill chunk
  pays the rest. Splitting the engine's estimate in the cost model's
  proportion instead charged decode part of every difference between the
  engine's count of a long chunk's attention and the cost model's: with long
  prompts beside three decoders, decode's intensity rose 21 %.
- Bytes read: decode pays what a decode-only step of its batch would read by
  the cost model — the weights its tokens touch once (all of them for a dense
  model), plus its sequences' KV cache (estimated
  as the cache in use less the chunk's tokens), at most the step's total; the
  prefill chunk pays the rest, everything it adds (its KV, its activations).
- Bytes written: decode pays its new tokens' KV entries; the chunk the rest.
- Time is split in proportion to each phase's roofline time for the work it
  was charged (max of bytes ÷ peak bandwidth and FLOPs ÷ peak FLOP/s).

**Speculative decoding.** A verify step checks k + 1 positions per sequence (its drafts and one of
its own) in one pass: it is a decode step whatever the number of positions, and its drafter's work is
decode's too. Its figures come from the cost model, never from the engine's estimate (vLLM's counts a
sequence with several new positions as prefill and its LM head once). Positions computed (`tokens`) and
tokens emitted (`emitted_tokens`) are counted apart. How a verify step's work, its emitted tokens, its
useful and wasted FLOPs and the drafter's work and time are counted is the speculation module's
(`phasescope.telemetry.model.speculation`, whose rules the roofline calculator follows too). Beside each
verify step goes the roofline time of a plain decode step of the same sequences at the same context, so
a window can say whether speculation pays (`window.SpeculationFigures`).

**LoRA adapters.** Neither the engine's estimate nor the base cost model counts them, so a step's adapters
are added on top (`adapter_work`): each distinct adapter the step ran reads its A and B matrices once
(`phasescope.telemetry.model.adapter.AdapterShape.bytes`), shared between its prompt chunks and its decodes
by their tokens, and costs its FLOPs per token for each of its sequences' tokens, each phase its own; per
device, the matrices sharded as the model is. The cross-check of the engine's estimate (`model_flops`,
`model_read_bytes`) stays the base model's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from phasescope.telemetry.model.adapter import NamedAdapter, adapter_step_work
from phasescope.telemetry.model.cost import ModelCost
from phasescope.telemetry.model.speculation import (
    Drafter,
    decode_work,
    draft_work,
    drafter_seconds,
    emitted_tokens,
    useful_flops,
    verify_work,
)
from phasescope.telemetry.step.records import StepRecord


@dataclass(frozen=True, slots=True)
class PhaseShare:
    """The part of one step charged to one phase."""

    tokens: int
    """Positions computed (decode's drafts included under speculative decoding)."""
    requests: int
    seconds: float
    flops: float
    read_bytes: float
    written_bytes: float
    emitted_tokens: int
    """Tokens the phase produced: `tokens` less the rejected drafts (prefill: its prompt tokens)."""

    @property
    def moved_bytes(self) -> float:
        return self.read_bytes + self.written_bytes


EMPTY_SHARE = PhaseShare(0, 0, 0.0, 0.0, 0.0, 0.0, 0)


@dataclass(frozen=True, slots=True)
class SpeculativeCost:
    """A verify step's decode work under speculative decoding (`phasescope.telemetry.model.speculation`)."""

    requests: int
    positions: int
    emitted_tokens: int
    useful_flops: float
    """The verify FLOPs of the positions that emitted a token."""
    wasted_flops: float
    """The verify FLOPs of the rejected drafts."""
    drafter_flops: float
    drafter_bytes: float
    drafter_seconds: float
    """The drafter's share of the step's decode time (its roofline share)."""
    verify_memory_seconds: float
    """The verify work's bytes ÷ peak bandwidth."""
    verify_compute_seconds: float
    """The verify work's FLOPs ÷ peak FLOP/s."""
    speculative_seconds: float
    """The roofline's time for the verify and the drafter's work."""
    plain_seconds: float
    """The roofline's time for a plain decode step of the same sequences at the same context."""


@dataclass(frozen=True, slots=True)
class AdapterCharge:
    """One adapter's part of a step, per device."""

    name: str
    tokens: int
    """Its sequences' tokens in the step, both phases."""
    flops: float
    read_bytes: float


@dataclass(frozen=True, slots=True)
class AdapterWork:
    """What a step's LoRA adapters add, per device, by phase: each distinct adapter's A and B matrices read once
    (shared between its prompt chunks and its decodes by their tokens), and its FLOPs per token; and each
    adapter's part (`each`), which the adapter series count."""

    prefill_flops: float = 0.0
    decode_flops: float = 0.0
    prefill_bytes: float = 0.0
    decode_bytes: float = 0.0
    each: tuple[AdapterCharge, ...] = ()


NO_ADAPTER_WORK = AdapterWork()
"""A step that ran no adapter (most steps): one shared value, not one made per step."""


def adapter_work(step: StepRecord, adapters: Mapping[int, NamedAdapter], devices: int = 1) -> AdapterWork:
    """The step's adapters' work (`AdapterWork`); an adapter the engine does not know (yet) adds nothing."""
    if not step.adapters:
        return NO_ADAPTER_WORK
    prefill_flops = decode_flops = prefill_bytes = decode_bytes = 0.0
    each = []
    for tokens in step.adapters:
        adapter = adapters.get(tokens.adapter)
        total = tokens.prefill_tokens + tokens.decode_tokens
        if adapter is None or not total:
            continue
        flops, read_bytes = adapter_step_work(adapter.shape, total, devices)
        prefill_flops += flops * tokens.prefill_tokens / total
        decode_flops += flops * tokens.decode_tokens / total
        prefill_bytes += read_bytes * tokens.prefill_tokens / total
        decode_bytes += read_bytes * tokens.decode_tokens / total
        each.append(AdapterCharge(adapter.name, total, flops, read_bytes))
    return AdapterWork(prefill_flops, decode_flops, prefill_bytes, decode_bytes, tuple(each))


@dataclass(frozen=True, slots=True)
class StepCost:
    """A step's totals and their attribution to the phases."""

    flops: float
    read_bytes: float
    written_bytes: float
    model_flops: float
    """The project's cost model's FLOPs for the step (the cross-check of the engine's estimate)."""
    model_read_bytes: float
    shares: dict[str, PhaseShare]
    speculative: SpeculativeCost | None = None
    """Under speculative decoding, a verify step's decode work."""
    adapters: AdapterWork = NO_ADAPTER_WORK
    """What the step's LoRA adapters added (included in the totals and the shares)."""


def decode_context_tokens(step: StepRecord) -> int:
    """Tokens in the KV cache of the step's decoding sequences: the cache in use less the chunks' tokens."""
    return max(0, step.kv_cache_tokens - step.prefill_tokens)


class StepAttributor:
    """`attribute_step` for one model against one device's peaks, with what every step reads of the cost model
    worked out once (the aggregator attributes every engine step)."""

    def __init__(
        self,
        cost: ModelCost,
        peak_bandwidth_bytes_per_second: float,
        peak_flops: float,
        drafter: Drafter | None = None,
        *,
        adapters: Mapping[int, NamedAdapter] | None = None,
    ) -> None:
        """`drafter`: what proposes the drafts under speculative decoding (None: it is off); host code or a draft
        model, whose work is counted (a draft cost ratio has none: ValueError). `adapters`: the LoRA adapters a
        step may name, by their id in the engine (`adapter_work`)."""
        if drafter is not None and drafter.cost_ratio:
            raise ValueError("the step attribution counts a draft model's work: a draft cost ratio is the calculator's")
        self.cost = cost
        self.drafter = drafter
        self._bandwidth = peak_bandwidth_bytes_per_second
        self._flops = peak_flops
        self._kv_bytes = cost.device_kv_cache_bytes_per_token
        self._adapters: Mapping[int, NamedAdapter] = adapters if adapters is not None else {}
        # A dense model's step reads all its weights, whatever its tokens.
        self._dense_weights = cost.device_weight_bytes if cost.experts is None else None

    def _weights_read(self, tokens: int) -> float:
        return self._dense_weights if self._dense_weights is not None else self.cost.weights_read(tokens)

    def _roofline_seconds(self, flops: float, moved_bytes: float) -> float:
        return max(moved_bytes / self._bandwidth, flops / self._flops)

    def _decode_attention_pairs(self, step: StepRecord) -> float:
        """Each decode position (drafts included) attends to its sequence's context."""
        positions_per_sequence = step.decode_tokens / step.decode_requests if step.decode_requests else 1.0
        return decode_context_tokens(step) * positions_per_sequence

    def model_step_cost(self, step: StepRecord) -> tuple[float, float, float]:
        """(FLOPs, bytes read, bytes written) on each device of a step's target-model work, by the project's own
        cost model (a drafter's work is apart: `_drafter_work`)."""
        tokens = step.prefill_tokens + step.decode_tokens
        # FLOPs: the prefill chunks (LM head once per request, attention within the chunk) and the
        # decode positions (LM head each, attention over their sequences' context).
        decode_flops = self.cost.decode_flops(step.decode_tokens, self._decode_attention_pairs(step))
        flops = self.cost.prefill_flops(step.prefill_tokens, step.prefill_requests) + decode_flops
        # Bytes read ≈ the weights the step's tokens touch (once per step) + the KV cache of the running sequences.
        read_bytes = self._weights_read(tokens) + step.kv_cache_tokens * self._kv_bytes
        # Bytes written ≈ each computed token's new KV entries.
        written_bytes = tokens * self._kv_bytes
        return flops, read_bytes, written_bytes

    def _drafter_work(self, step: StepRecord) -> tuple[float, float]:
        """(FLOPs, bytes moved) of the drafter in a verify step (`speculation.draft_work`) over the sequences whose
        drafts the step verified, at their share of the decoding sequences' context."""
        drafter, speculative = self.drafter, step.speculative
        if drafter is None or speculative is None:
            return 0.0, 0.0
        sequences = speculative.drafts
        context = decode_context_tokens(step) * sequences / max(1, step.decode_requests)
        return draft_work(drafter, sequences, context)

    def _verify(self, step: StepRecord) -> tuple[float, float, float]:
        """(FLOPs, bytes read, bytes written) of a decode-only step of the same positions (`speculation.verify_work`):
        what the decode of a mixed step pays, and what a verify step's drafts are judged by."""
        verify = verify_work(
            self.cost, step.decode_tokens, decode_context_tokens(step), self._decode_attention_pairs(step)
        )
        return verify.flops, verify.read_bytes, verify.written_bytes

    def _plain_decode_seconds(self, step: StepRecord) -> float:
        """The roofline's time for a decode step of the same sequences without drafts."""
        plain = decode_work(self.cost, step.decode_requests, decode_context_tokens(step))
        return self._roofline_seconds(plain.flops, plain.moved_bytes)

    def __call__(self, step: StepRecord) -> StepCost:
        """Totals of a step (the engine's estimate when it gives one) and each phase's charge (module docstring)."""
        model_flops, model_read, model_written = self.model_step_cost(step)
        speculative = step.speculative
        drafter_flops, drafter_bytes = self._drafter_work(step)
        if speculative is None:
            flops = step.flops if step.flops is not None else model_flops
            read_bytes = step.read_bytes if step.read_bytes is not None else model_read
            written_bytes = step.written_bytes if step.written_bytes is not None else model_written
        else:  # the engine's estimate takes a verify step for prefill: the cost model's, and the drafter's work
            flops, read_bytes, written_bytes = model_flops + drafter_flops, model_read + drafter_bytes, model_written
        # The LoRA adapters' matrices and FLOPs, which neither estimate counts: on top, each phase its own part.
        adapters = adapter_work(step, self._adapters, self.cost.devices)
        flops += adapters.prefill_flops + adapters.decode_flops
        read_bytes += adapters.prefill_bytes + adapters.decode_bytes
        emitted = (
            emitted_tokens(step.decode_tokens, speculative.rejected_tokens)
            if speculative is not None
            else step.decode_tokens
        )
        kind = step.kind
        if kind == "prefill":
            prefill = PhaseShare(
                step.prefill_tokens,
                step.prefill_requests,
                step.elapsed_seconds,
                flops,
                read_bytes,
                written_bytes,
                step.prefill_tokens,
            )
            shares = {"prefill": prefill, "decode": EMPTY_SHARE}
            return StepCost(flops, read_bytes, written_bytes, model_flops, model_read, shares, adapters=adapters)
        # Decode pays what a decode-only step of its batch would move: the weights once and
        # its own sequences' KV (by the cost model, at most the step's total), and its drafter's work; the chunk
        # pays the rest, everything it adds (its KV, its activations). A decode-only step without drafts reads no
        # verify figures: they are worked out only for a mixed step or a verify step, once.
        if kind == "mixed" or speculative is not None:
            verify_flops, verify_read, verify_written = self._verify(step)
        if kind == "decode":
            decode_flops, decode_read, decode_written = flops, read_bytes, written_bytes
            decode_seconds = step.elapsed_seconds
        else:
            decode_flops = min(flops, verify_flops + drafter_flops + adapters.decode_flops)
            decode_read = min(read_bytes, verify_read + drafter_bytes + adapters.decode_bytes)
            decode_written = min(written_bytes, verify_written)
            decode_time = self._roofline_seconds(decode_flops, decode_read + decode_written)
            prefill_time = self._roofline_seconds(
                flops - decode_flops, read_bytes - decode_read + written_bytes - decode_written
            )
            total_time = decode_time + prefill_time
            share = (
                decode_time / total_time
                if total_time
                else step.decode_tokens / (step.decode_tokens + step.prefill_tokens)
            )
            decode_seconds = step.elapsed_seconds * share
        decode = PhaseShare(
            step.decode_tokens,
            step.decode_requests,
            decode_seconds,
            decode_flops,
            decode_read,
            decode_written,
            emitted,
        )
        prefill = PhaseShare(
            step.prefill_tokens,
            step.prefill_requests,
            step.elapsed_seconds - decode_seconds,
            flops - decode_flops,
            read_bytes - decode_read,
            written_bytes - decode_written,
            step.prefill_tokens,
        )
        shares = {"prefill": prefill, "decode": decode}
        if speculative is None:
            return StepCost(flops, read_bytes, written_bytes, model_flops, model_read, shares, adapters=adapters)
        verify_seconds = self._roofline_seconds(verify_flops, verify_read + verify_written)
        drafter_roofline_seconds = self._roofline_seconds(drafter_flops, drafter_bytes)
        useful = useful_flops(verify_flops, step.decode_tokens, emitted)
        speculation = SpeculativeCost(
            requests=step.decode_requests,
            positions=step.decode_tokens,
            emitted_tokens=emitted,
            useful_flops=useful,
            wasted_flops=verify_flops - useful,
            drafter_flops=drafter_flops,
            drafter_bytes=drafter_bytes,
            drafter_seconds=drafter_seconds(decode_seconds, verify_seconds, drafter_roofline_seconds),
            verify_memory_seconds=(verify_read + verify_written) / self._bandwidth,
            verify_compute_seconds=verify_flops / self._flops,
            speculative_seconds=verify_seconds + drafter_roofline_seconds,
            plain_seconds=self._plain_decode_seconds(step),
        )
        return StepCost(flops, read_bytes, written_bytes, model_flops, model_read, shares, speculation, adapters)


def attribute_step(
    step: StepRecord,
    cost: ModelCost,
    peak_bandwidth_bytes_per_second: float,
    peak_flops: float,
    drafter: Drafter | None = None,
    *,
    adapters: Mapping[int, NamedAdapter] | None = None,
) -> StepCost:
    """Totals of a step (the engine's estimate when it gives one) and each phase's charge (module docstring)."""
    return StepAttributor(cost, peak_bandwidth_bytes_per_second, peak_flops, drafter, adapters=adapters)(step)
