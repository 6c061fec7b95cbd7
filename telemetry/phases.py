"""Phase durations of one request, derived from the engine's own timestamps.

vLLM stamps a request in the engine-core process with `time.monotonic()`
(`queued_ts`, `scheduled_ts`, `first_token_ts`, `last_token_ts`) and in the
front end with wall-clock `arrival_time`. On Linux the monotonic clock is
system-wide, so one offset (wall - monotonic) measured in the front end puts
every engine timestamp on the wall clock. Timers around handlers are never
used: they would count gRPC and Python scheduling as engine work.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


def monotonic_to_wall_offset_seconds() -> float:
    """Seconds to add to a `time.monotonic()` reading to get `time.time()`."""
    return time.time() - time.monotonic()


@dataclass(frozen=True, slots=True)
class EngineTimestamps:
    """A request's timestamps as the engine recorded them; 0.0 means never reached."""

    arrival_time: float
    """Wall clock (seconds since the epoch) when the front end received the request."""
    queued_ts: float
    """Engine monotonic clock: the request entered the scheduler's waiting queue."""
    scheduled_ts: float
    """Engine monotonic clock: the request was first scheduled."""
    first_token_ts: float
    """Engine monotonic clock: the first output token was produced."""
    last_token_ts: float
    """Engine monotonic clock: the latest output token was produced."""


@dataclass(frozen=True, slots=True)
class PhaseTimings:
    """Where a request's time went. A phase it never reached is None."""

    queue_seconds: float | None
    prefill_seconds: float | None
    decode_seconds: float | None
    time_to_first_token_seconds: float | None
    e2e_seconds: float | None
    mean_inter_token_seconds: float | None
    decode_tokens_per_second: float | None


def _interval(start: float, end: float) -> float | None:
    if start <= 0.0 or end <= 0.0:
        return None
    return max(0.0, end - start)


def derive_phase_timings(stamps: EngineTimestamps, completion_tokens: int, wall_offset_seconds: float) -> PhaseTimings:
    """Split a request into queue, prefill and decode (vLLM's definitions).

    `wall_offset_seconds` is `monotonic_to_wall_offset_seconds()` of the front end.
    """
    # Queue interval is from QUEUED to first SCHEDULED.
    queue = _interval(stamps.queued_ts, stamps.scheduled_ts)
    # Prefill interval is from first SCHEDULED to first NEW_TOKEN
    # (a preemption counts toward the phase in which it happens).
    prefill = _interval(stamps.scheduled_ts, stamps.first_token_ts)
    # Decode interval is from first NEW_TOKEN to last NEW_TOKEN.
    decode = _interval(stamps.first_token_ts, stamps.last_token_ts)

    arrival_monotonic = stamps.arrival_time - wall_offset_seconds if stamps.arrival_time > 0 else 0.0
    # TTFT = first token - arrival; E2E = last token - arrival. Arrival is wall
    # clock, so it is moved onto the engine's monotonic clock first.
    ttft = _interval(arrival_monotonic, stamps.first_token_ts)
    e2e = _interval(arrival_monotonic, stamps.last_token_ts)

    # TPOT = decode / (output tokens - 1): the first token belongs to prefill.
    decoded_tokens = completion_tokens - 1
    mean_inter_token: float | None = None
    decode_tokens_per_second: float | None = None
    if decode is not None and decoded_tokens >= 1:
        mean_inter_token = decode / decoded_tokens
        decode_tokens_per_second = decoded_tokens / decode if decode > 0 else None
    return PhaseTimings(
        queue_seconds=queue,
        prefill_seconds=prefill,
        decode_seconds=decode,
        time_to_first_token_seconds=ttft,
        e2e_seconds=e2e,
        mean_inter_token_seconds=mean_inter_token,
        decode_tokens_per_second=decode_tokens_per_second,
    )


@dataclass(frozen=True, slots=True)
class RequestParameters:
    """What the request asked for, as tracing reports it (gen_ai.request.*)."""

    operation: str = "text_completion"
    """"chat" for chat input, "text_completion" for a prompt or token ids."""
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None


@dataclass(frozen=True, slots=True)
class RequestText:
    """Prompt and output text; present only when an operator turned text capture on."""

    prompt: str
    output: str


@dataclass(frozen=True, slots=True)
class PhaseRecord:
    """One finished request, as observers see it. Holds no request id, and no text unless `text` is set."""

    model: str
    """The served model name (a bounded label)."""
    code: str
    """gRPC status code name the request ended with, e.g. "OK", "CANCELLED"."""
    finish_reason: str
    """"stop", "length", "abort", or "error" when the engine never finished it."""
    prompt_tokens: int
    cached_prompt_tokens: int
    """Prompt tokens served from the prefix cache instead of being computed."""
    completion_tokens: int
    timings: PhaseTimings
    inter_token_seconds: tuple[float, ...] = ()
    """Each gap between consecutive output tokens, on the engine's clock."""
    stamps: EngineTimestamps | None = None
    """The engine's raw timestamps, for observers that place phases in time (tracing)."""
    wall_offset_seconds: float = 0.0
    """Add to an engine timestamp to get wall-clock seconds (monotonic_to_wall_offset_seconds)."""
    ended_wall_time: float = 0.0
    """Wall clock when the request ended in the front end (its end when it never produced a token)."""
    parameters: RequestParameters = RequestParameters()
    error: BaseException | None = None
    """Why the request did not finish normally (its status is `code`)."""
    trace_id: str | None = None
    """Hex trace id of the request's trace when it is sampled, for exemplars."""
    text: RequestText | None = None

    @property
    def prefill_tokens_computed(self) -> int:
        """Prompt tokens the engine actually ran through prefill."""
        return max(0, self.prompt_tokens - self.cached_prompt_tokens)
