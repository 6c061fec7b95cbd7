"""Phase durations of one request, on one clock.

The engine core stamps a request with `time.monotonic()` of its own process
(`queued_ts`, `scheduled_ts`, `first_token_ts`, `last_token_ts`). On Linux
that clock is system-wide, so the front end compares those stamps directly
with its own `time.monotonic()` readings for the same request: handler entry,
hand-off to the engine, first chunk written, end. No offset is taken at
start-up: a wall-clock step would shift every later request. The wall clock
is read once per request, at entry, only to place its spans in a trace.

Timers around handlers never stand in for engine phases: they would count
gRPC and Python scheduling as engine work.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass
from typing import Any, get_args

from phasescope.telemetry.errors import log_rate_limited
from phasescope.telemetry.request.adapters import BASE_ADAPTER
from phasescope.telemetry.request.stages import (
    ABANDONED,
    DECODE,
    FRONTEND,
    INTAKE,
    KV_TRANSFER,
    PREFILL,
    QUEUE,
    STAGES,
    FrontendStamp,
    Stage,
    Stamp,
)
from phasescope.telemetry.step.interference import NO_INTERFERENCE, Interference

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineTimestamps:
    """A request's timestamps as the engine core recorded them (monotonic); 0.0 means never reached.

    vLLM sends them only with a request's outputs: a request that ends before its first token has none.
    """

    queued_ts: float
    """The request entered the scheduler's waiting queue."""
    scheduled_ts: float
    """The request was first scheduled."""
    first_token_ts: float
    """The first output token was produced."""
    last_token_ts: float
    """The latest output token was produced."""
    transfer: KvTransferFigures | None = None
    """On the request's last step, with a KV connector: what the connector moved for it."""

    @property
    def kv_transfer_start(self) -> float:
        return self.transfer.start if self.transfer is not None else 0.0

    @property
    def kv_transfer_end(self) -> float:
        return self.transfer.start + self.transfer.seconds if self.transfer is not None else 0.0


@dataclass(frozen=True, slots=True)
class KvTransferFigures:
    """What phasescope's KV connector moved for one request on this worker (`phasescope.engine.vllm.kv_connector`):
    the KV another worker computed, loaded, and the KV computed here for another, saved."""

    start: float
    """Where the first move began (monotonic)."""
    seconds: float
    """The moves' own time: loading and saving."""
    loaded_tokens: int
    """Prompt tokens whose KV came through the connector (vLLM's `external_kv_transfer` source)."""
    saved_tokens: int
    """Prompt tokens whose KV this worker computed and saved through the connector."""
    bytes: float
    """KV bytes moved, both ways (tokens × the KV cache's bytes per token)."""

    @property
    def moved(self) -> bool:
        return self.seconds > 0.0 or self.loaded_tokens > 0 or self.saved_tokens > 0

    @classmethod
    def from_params(cls, params: dict[str, Any] | None) -> tuple[dict[str, Any] | None, KvTransferFigures | None]:
        """A request's last `kv_transfer_params` as the engine core returns them: the connector's own parameters
        (None when there are none) and phasescope's connector's figures, which it adds under `PARAMS_KEY`."""
        if not params or KV_TRANSFER_PARAMS_KEY not in params:
            return params or None, None
        rest = {key: value for key, value in params.items() if key != KV_TRANSFER_PARAMS_KEY}
        figures = params[KV_TRANSFER_PARAMS_KEY]
        starts = [start for start in (figures["load_start"], figures["save_start"]) if start > 0.0]
        transfer = cls(
            start=min(starts, default=0.0),
            seconds=figures["load_seconds"] + figures["save_seconds"],
            loaded_tokens=int(figures["loaded_tokens"]),
            saved_tokens=int(figures["saved_tokens"]),
            bytes=float(figures["bytes"]),
        )
        return rest or None, transfer


KV_TRANSFER_PARAMS_KEY = "phasescope_kv_transfer"
"""Where phasescope's KV connector puts a request's figures in its last output's `kv_transfer_params` (the front
end takes them out before anyone sees the parameters)."""


@dataclass(frozen=True, slots=True)
class FrontendTimestamps:
    """What the front end saw of a request, on the same monotonic clock; 0.0 means not (yet) reached."""

    entry: float
    """The handler was entered: what the client waits for starts here."""
    wall_at_entry: float
    """`time.time()` read at entry, to place the request's spans on the wall clock."""
    handed_to_engine: float = 0.0
    """The request was handed to the engine client (validated, tokenised, admitted)."""
    first_chunk_written: float = 0.0
    """The first chunk of a stream was written to the client."""
    ended: float = 0.0
    """The front end finished with the request (last chunk written, or it failed)."""

    def wall(self, monotonic: float) -> float:
        """Wall-clock seconds of a monotonic reading, by this request's own offset."""
        return self.wall_at_entry + (monotonic - self.entry)


@dataclass(frozen=True, slots=True)
class PhaseTimings:
    """Where a request's time went. A stage it never reached, or never left, is None."""

    frontend_seconds: float | None
    queue_seconds: float | None
    prefill_seconds: float | None
    decode_seconds: float | None
    time_to_first_token_seconds: float | None
    e2e_seconds: float | None
    mean_inter_token_seconds: float | None
    decode_tokens_per_second: float | None
    client_time_to_first_token_seconds: float | None = None
    intake_seconds: float | None = None
    """Hand-off → queued: vLLM's input processing, the hop to the engine core, and the wait for
    the core to take the request in (it does so between steps: under load, up to a step)."""
    decode_stalled_by_prefill_seconds: float | None = None
    """Decode time spent in steps that also carried other requests' prefill chunks; None before decode."""
    decode_prefill_interference_seconds: float | None = None
    """The estimated extra decode time those chunks cost (step time − a decode-only step of the batch)."""
    abandoned_seconds: float | None = None
    """For a request that ended before its first token: hand-off to the engine → end.
    The engine stamps nothing before a request's first token, so this time in queue or
    prefill cannot be split between the two."""
    speculative_drafted_tokens: int = 0
    """Under speculative decoding, once the sample has ended: the tokens its drafter proposed."""
    speculative_accepted_tokens: int = 0
    """Under speculative decoding, once the sample has ended: the drafted tokens its verify steps kept."""
    kv_transfer_seconds: float | None = None
    """With a KV connector, once the request has ended: the time the connector spent moving its KV (`stages`)."""
    kv_loaded_tokens: int = 0
    """With a KV connector, once the request has ended: prompt tokens whose KV was loaded, not computed."""
    kv_saved_tokens: int = 0
    """With a KV connector, once the request has ended: prompt tokens whose KV was saved for another worker."""
    kv_transfer_bytes: float = 0.0
    """With a KV connector, once the request has ended: the KV bytes moved, both ways."""

    def seconds(self, stage: Stage) -> float | None:
        """The stage's duration (`stages.STAGES`); None when the request never reached or left it."""
        value: float | None = getattr(self, stage.seconds_field)
        return value


_FRONTEND_STAMPS: frozenset[str] = frozenset(get_args(FrontendStamp))


def stamp_value(stamp: Stamp, front: FrontendTimestamps, engine: EngineTimestamps | None) -> float:
    """A stage boundary's reading on the one monotonic clock; 0.0 means never reached."""
    if stamp in _FRONTEND_STAMPS:
        return float(getattr(front, stamp))
    return float(getattr(engine, stamp)) if engine is not None else 0.0


def _interval(name: str, start: float, end: float) -> float | None:
    if start <= 0.0 or end <= 0.0:
        return None
    if end < start:
        # Both ends are on one system-wide clock, so this is a defect somewhere: say so
        # rather than hide it as 0 (it is left out of the figures).
        log_rate_limited(
            logger, f"negative:{name}", "negative %s interval (%.6f s) left out of the figures", name, end - start
        )
        return None
    return end - start


# The stamps a stage can open or close on, in the order `derive_phase_timings` reads them.
_STAMP_ORDER: tuple[Stamp, ...] = (
    "entry", "handed_to_engine", "ended", "queued_ts", "scheduled_ts", "first_token_ts", "last_token_ts",
    "kv_transfer_start", "kv_transfer_end",
)  # fmt: skip
_engine_stamps = operator.attrgetter(*_STAMP_ORDER[3:])
# Per stage: its name, where its two stamps are in that order, and whether it exists only without a first token.
_STAGE_STAMPS = tuple(
    (stage.name, _STAMP_ORDER.index(stage.start), _STAMP_ORDER.index(stage.end), stage.only_without_first_token)
    for stage in STAGES
)


def derive_phase_timings(
    front: FrontendTimestamps,
    engine: EngineTimestamps | None,
    completion_tokens: int,
    interference: Interference | None = None,
) -> PhaseTimings:
    """Split a request into its stages (`stages.STAGES`: vLLM's definitions for the engine's phases).

    `interference` is what other requests' prefill chunks cost this request's decode so far
    (the step aggregator's ledger, read by the request's lifecycle)."""
    first_token = engine.first_token_ts if engine is not None else 0.0
    # Each stage is the interval between its two stamps (the table says what each holds).
    if engine is not None:
        stamps = (front.entry, front.handed_to_engine, front.ended, *_engine_stamps(engine))
    else:
        stamps = (front.entry, front.handed_to_engine, front.ended, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    seconds: dict[str, float | None] = {}
    for name, start_at, end_at, only_without_first_token in _STAGE_STAMPS:
        if only_without_first_token and first_token > 0.0:
            continue
        start, end = stamps[start_at], stamps[end_at]
        seconds[name] = end - start if start > 0.0 and end >= start else _interval(name, start, end)
    decode = seconds[DECODE.name]
    # What a KV connector moved for the request (on its last step; nothing moved is no transfer).
    transfer = engine.transfer if engine is not None and engine.transfer is not None and engine.transfer.moved else None
    # TTFT = first token − handler entry; E2E = last token − handler entry. Both include
    # the frontend and intake stages (vLLM's own start later, at its arrival stamp).
    ttft = _interval("time to first token", front.entry, first_token)
    e2e = _interval("end-to-end", front.entry, engine.last_token_ts if engine is not None else 0.0)
    # Client TTFT = first chunk written − handler entry: what a streaming client waited.
    client_ttft = _interval("client time to first token", front.entry, front.first_chunk_written)

    # TPOT = decode / (output tokens - 1): the first token belongs to prefill.
    decoded_tokens = completion_tokens - 1
    decoded = decode is not None and decoded_tokens >= 1
    mean_inter_token: float | None = None
    decode_tokens_per_second: float | None = None
    if decode is not None and decoded_tokens >= 1:
        mean_inter_token = decode / decoded_tokens
        decode_tokens_per_second = decoded_tokens / decode if decode > 0 else None
    return PhaseTimings(
        frontend_seconds=seconds[FRONTEND.name],
        queue_seconds=seconds[QUEUE.name],
        prefill_seconds=seconds[PREFILL.name],
        decode_seconds=decode,
        time_to_first_token_seconds=ttft,
        e2e_seconds=e2e,
        mean_inter_token_seconds=mean_inter_token,
        decode_tokens_per_second=decode_tokens_per_second,
        client_time_to_first_token_seconds=client_ttft,
        intake_seconds=seconds[INTAKE.name],
        # Only a request that decoded (a token after its first) has decode steps to share.
        decode_stalled_by_prefill_seconds=(interference or NO_INTERFERENCE).stalled_seconds if decoded else None,
        decode_prefill_interference_seconds=(interference or NO_INTERFERENCE).extra_seconds if decoded else None,
        abandoned_seconds=seconds.get(ABANDONED.name),
        kv_transfer_seconds=seconds[KV_TRANSFER.name] if transfer is not None else None,
        kv_loaded_tokens=transfer.loaded_tokens if transfer is not None else 0,
        kv_saved_tokens=transfer.saved_tokens if transfer is not None else 0,
        kv_transfer_bytes=transfer.bytes if transfer is not None else 0.0,
    )


@dataclass(frozen=True, slots=True)
class RequestParameters:
    """What the request asked for, as tracing reports it (gen_ai.request.*)."""

    operation: str = "text_completion"
    """"chat" for chat input, "text_completion" for a prompt or token ids."""
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    constraint: str = ""
    """The kind of its structured output (json_schema, regex, ...), or empty for none."""
    samples: int = 1
    adapter: str = ""
    """The LoRA adapter it ran with ("": the base model)."""


@dataclass(frozen=True, slots=True)
class RequestText:
    """Prompt and output text; present only when an operator turned text capture on."""

    prompt: str
    output: str


@dataclass(frozen=True, slots=True)
class FirstTokenRecord:
    """A request's first token, as observers see it: what is known once it arrived."""

    model: str
    timings: PhaseTimings
    """frontend, intake, queue, prefill and TTFT (client TTFT for a stream whose first chunk is written)."""
    prefill_tokens_computed: int
    """Prompt tokens the engine ran through prefill (prefix-cache hits excluded)."""
    streaming: bool
    trace_id: str | None = None
    sample: int = 0
    """The sample whose first token this is (a request with n samples has n first tokens)."""
    request_first: bool = True
    """The request's first first-token record: the stages its samples share (frontend, intake) and the
    client's time to first token are observed with this one only."""
    constraint: str = ""
    """The kind of the request's structured output (`StructuredKind`), or empty for none."""
    cached_prompt_tokens: int = 0
    """Prompt tokens the prefix cache served for this sequence."""
    adapter: str = BASE_ADAPTER
    """The request's adapter label (phasescope.telemetry.request.adapters)."""


@dataclass(frozen=True, slots=True)
class SampleRecord:
    """One sample of a request with n > 1 samples, as it ended: its own sequence's figures."""

    index: int
    finish_reason: str
    completion_tokens: int
    cached_prompt_tokens: int
    timings: PhaseTimings
    stamps: EngineTimestamps | None

    @property
    def produced_first_token(self) -> bool:
        return self.stamps is not None and self.stamps.first_token_ts > 0.0


@dataclass(frozen=True, slots=True)
class PhaseRecord:
    """One ended request, as observers see it. Holds no request id, and no text unless `text` is set."""

    model: str
    """The served model name (a bounded label)."""
    code: str
    """gRPC status code name the request ended with, e.g. "OK", "CANCELLED"."""
    finish_reason: str
    """"stop", "length", "abort", or "error" when the engine never finished it. With n samples: "abort"
    if one was aborted, else "length" if one ran out of tokens, else "stop"."""
    prompt_tokens: int
    cached_prompt_tokens: int
    """Prompt tokens served from the prefix cache instead of being computed (the first sample's)."""
    completion_tokens: int
    """Every sample's."""
    timings: PhaseTimings
    """The first sample's stages (the only sample's, for n = 1)."""
    front: FrontendTimestamps
    stamps: EngineTimestamps | None = None
    """The engine's raw timestamps (the first sample's), for observers that place phases in time (tracing)."""
    streaming: bool = True
    parameters: RequestParameters = RequestParameters()
    error: BaseException | None = None
    """Why the request did not finish normally (its status is `code`)."""
    trace_id: str | None = None
    """Hex trace id of the request's trace when it is sampled, for exemplars."""
    text: RequestText | None = None
    samples: tuple[SampleRecord, ...] = ()
    """With n > 1 samples: every sample (index 0 to n − 1), each its own sequence in the engine; the
    record's own timings, stamps and cached tokens are sample 0's. Empty for n = 1."""
    adapter: str = BASE_ADAPTER
    """The request's adapter label (phasescope.telemetry.request.adapters)."""

    @property
    def produced_first_token(self) -> bool:
        return self.stamps is not None and self.stamps.first_token_ts > 0.0

    @property
    def prefill_tokens_computed(self) -> int:
        """Prompt tokens the engine actually ran through prefill."""
        return max(0, self.prompt_tokens - self.cached_prompt_tokens)
