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
"""

from __future__ import annotations

from dataclasses import dataclass

from phasescope.telemetry.model.cost import ModelCost
from phasescope.telemetry.step.records import StepRecord


@dataclass(slots=True)
class PhaseShare:
    """The part of one step charged to one phase (made for every step: slotted, not frozen, as a frozen
    dataclass costs twice as much to make; treat it as a value)."""

    tokens: int
    requests: int
    seconds: float
    flops: float
    read_bytes: float
    written_bytes: float

    @property
    def moved_bytes(self) -> float:
        return self.read_bytes + self.written_bytes


@dataclass(slots=True)
class StepCost:
    """A step's totals and their attribution to the phases (one per step, like `PhaseShare`)."""

    flops: float
    read_bytes: float
    written_bytes: float
    model_flops: float
    """The project's cost model's FLOPs for the step (the cross-check of the engine's estimate)."""
    model_read_bytes: float
    shares: dict[str, PhaseShare]


def decode_context_tokens(step: StepRecord) -> int:
    """Tokens in the KV cache of the step's decoding sequences: the cache in use less the chunks' tokens."""
    return max(0, step.kv_cache_tokens - step.prefill_tokens)


class StepAttributor:
    """`attribute_step` for one model against one device's peaks, with what every step reads of the cost model
    worked out once (the aggregator attributes every engine step)."""

    def __init__(self, cost: ModelCost, peak_bandwidth_bytes_per_second: float, peak_flops: float) -> None:
        self.cost = cost
        self._bandwidth = peak_bandwidth_bytes_per_second
        self._flops = peak_flops
        self._kv_bytes = cost.device_kv_cache_bytes_per_token
        # A dense model's step reads all its weights, whatever its tokens.
        self._dense_weights = cost.device_weight_bytes if cost.experts is None else None

    def _weights_read(self, tokens: int) -> float:
        return self._dense_weights if self._dense_weights is not None else self.cost.weights_read(tokens)

    def model_step_cost(self, step: StepRecord) -> tuple[float, float, float]:
        """(FLOPs, bytes read, bytes written) on each device of a step, by the project's own cost model."""
        cost = self.cost
        tokens = step.prefill_tokens + step.decode_tokens
        # FLOPs: the prefill chunks (LM head once per request, attention within the chunk) and the
        # decode tokens (LM head each, attention over their sequences' context).
        flops = cost.prefill_flops(step.prefill_tokens, step.prefill_requests) + cost.decode_flops(
            step.decode_tokens, decode_context_tokens(step)
        )
        # Bytes read ≈ the weights the step's tokens touch (once per step) + the KV cache of the running sequences.
        read_bytes = self._weights_read(tokens) + step.kv_cache_tokens * self._kv_bytes
        # Bytes written ≈ each computed token's new KV entries.
        written_bytes = tokens * self._kv_bytes
        return flops, read_bytes, written_bytes

    def __call__(self, step: StepRecord) -> StepCost:
        """Totals of a step (the engine's estimate when it gives one) and each phase's charge (module docstring)."""
        cost = self.cost
        model_flops, model_read, model_written = self.model_step_cost(step)
        flops = step.flops if step.flops is not None else model_flops
        read_bytes = step.read_bytes if step.read_bytes is not None else model_read
        written_bytes = step.written_bytes if step.written_bytes is not None else model_written
        total_tokens = step.prefill_tokens + step.decode_tokens
        kind = step.kind
        if kind != "mixed":
            whole = PhaseShare(
                total_tokens,
                step.prefill_requests + step.decode_requests,
                step.elapsed_seconds,
                flops,
                read_bytes,
                written_bytes,
            )
            empty = PhaseShare(0, 0, 0.0, 0.0, 0.0, 0.0)
            shares = {"prefill": whole, "decode": empty} if kind == "prefill" else {"prefill": empty, "decode": whole}
            return StepCost(flops, read_bytes, written_bytes, model_flops, model_read, shares)
        token_share = step.decode_tokens / total_tokens
        # Decode pays what a decode-only step of its batch would move: the weights once and
        # its own sequences' KV (by the cost model, at most the step's total); the chunk pays
        # the rest, everything it adds (its KV, its activations).
        kv_bytes = self._kv_bytes
        decode_alone_read = self._weights_read(step.decode_tokens) + decode_context_tokens(step) * kv_bytes
        decode_read_bytes = min(read_bytes, decode_alone_read)
        decode_written = min(written_bytes, step.decode_tokens * kv_bytes)
        # FLOPs: decode pays its decode-only cost by the cost model (at most the step's); the chunk the rest.
        decode_flops = min(flops, cost.decode_flops(step.decode_tokens, decode_context_tokens(step)))
        prefill_flops, prefill_read_bytes = flops - decode_flops, read_bytes - decode_read_bytes
        prefill_written = written_bytes - decode_written

        def roofline_seconds(phase_flops: float, moved: float) -> float:
            return max(moved / self._bandwidth, phase_flops / self._flops)

        decode_time = roofline_seconds(decode_flops, decode_read_bytes + decode_written)
        prefill_time = roofline_seconds(prefill_flops, prefill_read_bytes + prefill_written)
        time_share = decode_time / (decode_time + prefill_time) if decode_time + prefill_time else token_share
        decode_seconds = step.elapsed_seconds * time_share
        shares = {
            "prefill": PhaseShare(
                step.prefill_tokens,
                step.prefill_requests,
                step.elapsed_seconds - decode_seconds,
                prefill_flops,
                prefill_read_bytes,
                prefill_written,
            ),
            "decode": PhaseShare(
                step.decode_tokens,
                step.decode_requests,
                decode_seconds,
                decode_flops,
                decode_read_bytes,
                decode_written,
            ),
        }
        return StepCost(flops, read_bytes, written_bytes, model_flops, model_read, shares)


def attribute_step(
    step: StepRecord, cost: ModelCost, peak_bandwidth_bytes_per_second: float, peak_flops: float
) -> StepCost:
    """Totals of a step (the engine's estimate when it gives one) and each phase's charge (module docstring)."""
    return StepAttributor(cost, peak_bandwidth_bytes_per_second, peak_flops)(step)
