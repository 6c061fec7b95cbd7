"""What other requests' prefill chunks cost a decoding request (pure)."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from phasescope.telemetry.step.records import StepRecord


@dataclass(frozen=True, slots=True)
class Interference:
    """What other requests' prefill cost a decoding request (or, as running totals, an engine's decodes)."""

    stalled_seconds: float = 0.0
    """Decode time spent in steps that also carried prefill chunks."""
    extra_seconds: float = 0.0
    """The estimated extra time those chunks cost: each such step's time minus what a decode-only
    step of the same batch takes (the engine's own recent decode-only steps)."""

    def __sub__(self, other: Interference) -> Interference:
        return Interference(self.stalled_seconds - other.stalled_seconds, self.extra_seconds - other.extra_seconds)


NO_INTERFERENCE = Interference()

DECODE_REFERENCE_SMOOTHING = 0.2
"""Weight of the newest decode-only step in the per-batch-size reference (an exponential average)."""


class InterferenceLedger:
    """Per engine, running totals of `Interference`, advanced once per engine step.

    The engine's steps and its requests' tokens come from the same engine-core output batches: the
    engine core publishes a batch's step report (phasescope.engine.vllm.core_telemetry) before it sends
    the batch's tokens, so a request that reads the totals when its tokens arrive and again when it
    finishes gets the steps of its decode (a step late at both ends when the report arrives after them).
    The reference for "a decode-only step of the same batch" is the exponential average of this
    engine's decode-only steps of that batch size, else of the nearest batch size seen; before any
    decode-only step, the roofline split of the mixed step (its decode share of the time) stands in.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals: dict[int, Interference] = {}
        self._decode_only: dict[int, dict[int, float]] = {}

    def record(self, step: StepRecord, decode_share_seconds: float) -> None:
        if step.kind == "prefill" or step.decode_requests == 0:
            return
        self.add(step.engine, step.decode_requests, step.kind == "mixed", step.elapsed_seconds, decode_share_seconds)

    def add(
        self, engine: int, decode_requests: int, mixed: bool, elapsed_seconds: float, decode_share_seconds: float
    ) -> None:
        """A step that decoded `decode_requests` requests (`record`'s, from the step's figures alone): `mixed`
        when prefill shared it; `decode_share_seconds` as in `record`, read only for a mixed step before the
        engine's first decode-only one."""
        with self._lock:
            references = self._decode_only.setdefault(engine, {})
            if not mixed:
                old = references.get(decode_requests)
                references[decode_requests] = (
                    elapsed_seconds if old is None else old + DECODE_REFERENCE_SMOOTHING * (elapsed_seconds - old)
                )
                return
            reference = references.get(decode_requests)
            if reference is None and references:
                nearest = min(references, key=lambda batch: abs(batch - decode_requests))
                reference = references[nearest]
            alone = reference if reference is not None else decode_share_seconds
            total = self._totals.get(engine, Interference())
            self._totals[engine] = Interference(
                total.stalled_seconds + elapsed_seconds,
                total.extra_seconds + max(0.0, elapsed_seconds - alone),
            )

    def has_reference(self, engine: int) -> bool:
        """Whether the engine has had a decode-only step (until then a mixed step's `decode_share_seconds`
        stands in for one)."""
        return bool(self._decode_only.get(engine))

    def read(self, engine: int) -> Interference:
        """The engine's running totals; the same object until its next mixed step (read once per request
        per output pass, so it takes no lock: `record` replaces the totals whole, never mutates them)."""
        return self._totals.get(engine, NO_INTERFERENCE)
