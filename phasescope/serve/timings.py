"""A request's phase timings as phasescope.v1's `Timings` message: the last chunk of a phasescope.v1
stream carries it, and an engine-protocol stream its serialisation in trailing metadata."""

from __future__ import annotations

from phasescope.telemetry.request.phases import PhaseTimings
from phasescope.telemetry.request.stages import STAGES
from phasescope.v1 import inference_pb2 as pb

TIMINGS_METADATA_KEY = "phasescope-timings-bin"
"""The trailing-metadata key of an engine-protocol stream's timings (a serialised `phasescope.v1.Timings`)."""


def timings_message(timings: PhaseTimings, adapter: str = "") -> pb.Timings:
    """The contract's Timings of a sample's stages; `adapter`: the LoRA adapter it ran with ("": the base model)."""
    return pb.Timings(
        adapter=adapter,
        time_to_first_token_seconds=timings.time_to_first_token_seconds or 0.0,
        e2e_seconds=timings.e2e_seconds or 0.0,
        mean_inter_token_seconds=timings.mean_inter_token_seconds or 0.0,
        decode_tokens_per_second=timings.decode_tokens_per_second or 0.0,
        client_time_to_first_token_seconds=timings.client_time_to_first_token_seconds or 0.0,
        decode_stalled_by_prefill_seconds=timings.decode_stalled_by_prefill_seconds or 0.0,
        decode_prefill_interference_seconds=timings.decode_prefill_interference_seconds or 0.0,
        speculative_drafted_tokens=timings.speculative_drafted_tokens,
        speculative_accepted_tokens=timings.speculative_accepted_tokens,
        kv_loaded_tokens=timings.kv_loaded_tokens,
        kv_saved_tokens=timings.kv_saved_tokens,
        kv_transfer_bytes=timings.kv_transfer_bytes,
        # Each stage with a field of its own in the contract, set in one call (a field set afterwards costs more).
        **{name: getattr(timings, name) or 0.0 for name in _TIMED_FIELDS},
    )


TIMED_STAGES = tuple(stage for stage in STAGES if stage.seconds_field in pb.Timings.DESCRIPTOR.fields_by_name)
"""The stages `Timings` has a field for, in the table's order (abandoned has none: such a request gets no answer)."""
_TIMED_FIELDS = tuple(stage.seconds_field for stage in TIMED_STAGES)
