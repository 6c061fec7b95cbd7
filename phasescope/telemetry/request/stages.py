"""The one table of a request's stages: its name, the stamps that open and close it, what it holds.

Every reader takes the stages from here: the derivation (`phases.derive_phase_timings`), the
Prometheus histogram's `phase` label, the trace's child spans, the proto's `Timings`, the
command line's timing line and `top`'s request table. A stage is named after the interval,
and `PhaseTimings` holds its seconds as `<name>_seconds`.

The stamps are on one monotonic clock (`phases` says why): `entry`, `handed_to_engine` and
`ended` are the front end's readings, `queued_ts`, `scheduled_ts`, `first_token_ts` and
`last_token_ts` the engine core's, and `kv_transfer_start` and `kv_transfer_end` phasescope's KV connector's
inside the engine core (`phasescope.engine.vllm.kv_connector`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FrontendStamp = Literal["entry", "handed_to_engine", "ended"]
EngineStamp = Literal[
    "queued_ts", "scheduled_ts", "first_token_ts", "last_token_ts", "kv_transfer_start", "kv_transfer_end"
]
Stamp = FrontendStamp | EngineStamp


@dataclass(frozen=True, slots=True)
class Stage:
    name: str
    """The `phase` label, the span's name and the `Timings` field's stem."""
    start: Stamp
    end: Stamp
    includes: str
    """What the interval holds, in the words the docs use."""
    at_first_token: bool
    """Known once the first token is: observed then, not when the request ends."""
    without_first_token: bool = False
    """Observed for a request that ended before its first token (the engine stamped nothing)."""
    only_without_first_token: bool = False
    """Exists only for a request that ended before its first token."""
    nested: bool = False
    """Lies inside another stage (queue or prefill) instead of after it: not one of those that tile a request."""
    seconds_field: str = field(init=False)
    """`<name>_seconds`: where `PhaseTimings` and `Timings` hold it (made once: it is read many times a request)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "seconds_field", f"{self.name}_seconds")  # a frozen dataclass's own field


FRONTEND = Stage(
    "frontend",
    "entry",
    "handed_to_engine",
    "validation, chat templating, tokenisation and admission: the front end's own work",
    at_first_token=True,
    without_first_token=True,
)
INTAKE = Stage(
    "intake",
    "handed_to_engine",
    "queued_ts",
    "the engine client's input processing, the hop to the engine core, and the wait for the core "
    "to take the request in between two steps",
    at_first_token=True,
)
QUEUE = Stage("queue", "queued_ts", "scheduled_ts", "waiting in the engine's queue for a slot", at_first_token=True)
PREFILL = Stage(
    "prefill",
    "scheduled_ts",
    "first_token_ts",
    "the prompt's forward passes up to the first token (a preemption counts toward the phase it happens in)",
    at_first_token=True,
)
DECODE = Stage("decode", "first_token_ts", "last_token_ts", "every token after the first", at_first_token=False)
ABANDONED = Stage(
    "abandoned",
    "handed_to_engine",
    "ended",
    "for a request that ended before its first token: hand-off to its end; the engine stamps nothing "
    "before a request's first token, so this time in queue or prefill cannot be split",
    at_first_token=False,
    without_first_token=True,
    only_without_first_token=True,
)

KV_TRANSFER = Stage(
    "kv_transfer",
    "kv_transfer_start",
    "kv_transfer_end",
    "the KV connector moving this request's KV cache: loading what another worker computed (inside queue when "
    "the connector loads apart from the steps, inside prefill when it loads in the step) and saving what this "
    "worker computed for another (inside prefill); its seconds are the moves' own time, beginning where the "
    "first began",
    at_first_token=False,
    nested=True,
)

STAGES: tuple[Stage, ...] = (FRONTEND, INTAKE, QUEUE, PREFILL, DECODE, ABANDONED, KV_TRANSFER)
"""In the order a request passes through them (abandoned stands for intake, queue and prefill; kv_transfer lies
inside queue or prefill)."""

ANSWERED: tuple[Stage, ...] = tuple(
    stage for stage in STAGES if not stage.only_without_first_token and not stage.nested
)
"""The stages of a request that got its first token: they tile it from handler entry to its last token."""
