"""What the front end's CPU per token would be without a part of phasescope's work: a diagnostic, never a setting.

`phasescope serve` keeps all its telemetry on; to find how much of its front-end CPU per token a part
costs end to end (where the in-place timers of `front_end_step_cost` mislead: the same code runs
warmer or colder beside the rest), this runs the server with that part cut out and nothing else
changed, to be loaded side by side with the unchanged server or vLLM's gRPC worker
(`loadtests/serve_ab.py --a-what-if CUTS`). `PHASESCOPE_WHAT_IF` names the cuts, comma-separated:

- `no-step-telemetry`: `PhasescopeStatLogger.record` does nothing (no step records, window, views,
  interference, step series).
- `no-step-reports`: the step reports are made and the interference ledger kept, as served, but the held
  reports are dropped instead of handed on (no window, views, step series): what the batches cost apart
  from the part that runs with every step.
- `bare-took`: `RequestLifecycle.took` keeps only the sample's token count and stamps (no
  interference read, no token counter).
- `no-request-records`: no first-token or end-of-request record is built or observed (no request,
  phase or TTFT series, no recent latencies, no traces or request logs).
- `no-status-interceptor`: the server runs without `ExceptionToStatusInterceptor` (as vLLM's worker runs
  without any interceptor); Generate maps its own errors, other RPCs' errors would end as UNKNOWN.
- `no-engine-mfu`: not the front end's: the engine core runs without `enable_mfu_metrics` (vLLM's analytic
  FLOPs and bytes of every step, computed in the engine core between steps, which vLLM's worker does not
  ask for); the step telemetry falls back on phasescope's own cost model.
- `no-engine-step-details`: not the front end's: the engine core runs with neither `enable_mfu_metrics` nor
  `enable_logging_iteration_details` (each step's token counts and time, and its analytic FLOPs and bytes,
  neither of which vLLM's worker asks for). Without a step's details the front end makes no step record of
  it either (no window, views, interference or step series): an upper bound on what the per-step accounting
  costs, the engine core's share and the front end's together.
- `engine-core-blocks`: not the front end's either: in the engine core process, vLLM's shared-memory queue
  readers wait for the model worker's results polling their notification socket (at most 1 ms at a time)
  instead of spinning with `sched_yield`, which under `--pin-cpus` shares the front end's CPU. Made when the
  engine core imports this module again (`__mp_main__`, a process named `EngineCore...`).
- `switch-1ms`: not a cut but an addition: the server's interpreter hands the GIL to a waiting thread after
  1 ms instead of Python's 5 ms (`sys.setswitchinterval`), so grpc.aio's poller thread, which brings every
  new RPC and completed write to the event loop, waits less behind a busy loop.

- `timeline`: not a cut but an addition: every request's handler entry, hand-off, first chunk written and end,
  and every hand-on of held telemetry with its duration, written at exit to `$PHASESCOPE_TIMELINE_FILE`
  (`loadtests/wave_timeline.py` reads where a wave of new requests waits).

(A third cut, `held-vllm-prometheus`, handed vLLM's own `PrometheusStatLogger` 32 steps' reports at a
time; the server now does that itself, and hands them on before every scrape:
`phasescope.engine.vllm.stats.HeldPrometheusStatLogger`.)

    PHASESCOPE_WHAT_IF=no-step-telemetry,bare-took .venv/bin/python -m loadtests.front_end_what_if serve ...

The engine core is a spawned process that imports this module again: the patches are made only
in the server's own process (`__main__`), but for `engine-core-blocks`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

CUTS = (
    "no-step-telemetry",
    "no-step-reports",
    "bare-took",
    "no-request-records",
    "no-status-interceptor",
    "no-engine-mfu",
    "no-engine-step-details",
    "engine-core-blocks",
    "switch-1ms",
    "timeline",
)


def _no_step_telemetry() -> None:
    from phasescope.engine.vllm.stats import PhasescopeStatLogger

    def record(self: Any, *args: Any, **kwargs: Any) -> None:
        return None

    PhasescopeStatLogger.record = record  # type: ignore[method-assign]  # the cut being measured


def _no_step_reports() -> None:
    from phasescope.telemetry.step.aggregator import StepAggregator

    def flush_reports(self: Any) -> None:
        with self._held_lock:
            self._held = []

    StepAggregator.flush_reports = flush_reports  # type: ignore[method-assign]  # the cut being measured


def _bare_took() -> None:
    from phasescope.engine.base import EngineStep
    from phasescope.serve.lifecycle import RequestLifecycle

    def took(self: RequestLifecycle, step: EngineStep) -> None:
        sample = self.samples[step.index] if step.index else self.samples[0]
        self._current = sample
        sample.completion_tokens = max(sample.completion_tokens + len(step.token_ids), step.completion_tokens)
        if step.stamps is not None:
            sample.stamps = step.stamps

    RequestLifecycle.took = took  # type: ignore[method-assign]  # the cut being measured


def _no_request_records() -> None:
    from phasescope.serve.lifecycle import RequestLifecycle

    def nothing(self: RequestLifecycle, *args: Any) -> None:
        return None

    RequestLifecycle._report_first_token = nothing  # type: ignore[method-assign,assignment]  # the cut being measured
    RequestLifecycle._end = nothing  # type: ignore[method-assign,assignment]


def _no_status_interceptor() -> None:
    import grpc

    from phasescope.serve.interceptors import ExceptionToStatusInterceptor

    server = grpc.aio.server

    def without(**kwargs: Any) -> Any:
        kept = [
            each
            for each in kwargs.pop("interceptors", None) or ()
            if not isinstance(each, ExceptionToStatusInterceptor)
        ]
        return server(interceptors=kept or None, **kwargs)

    grpc.aio.server = without  # type: ignore[assignment]  # the cut being measured


def _engine_started_without(*flags: str) -> None:
    """The engine's `AsyncEngineArgs` made with each of `flags` False, whatever the server asks for."""
    import vllm.engine.arg_utils

    engine_args = vllm.engine.arg_utils.AsyncEngineArgs

    def without(**kwargs: Any) -> Any:
        return engine_args(**{**kwargs, **dict.fromkeys(flags, False)})

    vllm.engine.arg_utils.AsyncEngineArgs = without  # type: ignore[assignment,misc]  # the cut being measured


def _no_engine_mfu() -> None:
    _engine_started_without("enable_mfu_metrics")


def _no_engine_step_details() -> None:
    _engine_started_without("enable_mfu_metrics", "enable_logging_iteration_details")


def _engine_core_blocks() -> None:
    """In the engine core only: wait for the worker's results blocked on the queue's notification (at most 1 ms
    at a time: a notification can be dropped) instead of spinning (vLLM's readers spin with `sched_yield` for
    1 s after each read)."""
    import zmq
    from vllm.distributed.device_communicators import shm_broadcast

    def wait(self: Any, timeout_ms: int | None = None) -> None:
        events = dict(self.poller.poll(timeout=1 if timeout_ms is None else min(timeout_ms, 1)))
        if self.local_notify_socket in events:
            self.local_notify_socket.recv(flags=zmq.NOBLOCK, copy=False)

    shm_broadcast.SpinCondition.wait = wait  # type: ignore[method-assign]  # the cut being measured


def _switch_1ms() -> None:
    sys.setswitchinterval(0.001)


TIMELINE: list[tuple[float, str, object]] = []
"""The `timeline` addition's events: [time, event, detail]."""


def write_timeline() -> None:
    """The timeline so far, as JSON lines, to $PHASESCOPE_TIMELINE_FILE (`loadtests/wave_timeline.py` reads it)."""
    import json

    with open(os.environ.get("PHASESCOPE_TIMELINE_FILE", f"/tmp/phasescope-timeline-{os.getpid()}.jsonl"), "w") as out:
        for event in TIMELINE:
            out.write(json.dumps(event) + "\n")


def _timeline() -> None:
    """Not a cut: every request's entry, hand-off, first chunk written and end, and every hand-on of held
    telemetry with its duration, on the monotonic clock, written at exit (`write_timeline`) for
    `loadtests/wave_timeline.py` to read where a wave of new requests waits."""
    import atexit
    import time

    from phasescope.engine.vllm.stats import HeldPrometheusStatLogger
    from phasescope.serve.lifecycle import RequestLifecycle
    from phasescope.telemetry.request.observer import ObserverGroup
    from phasescope.telemetry.step.aggregator import StepAggregator

    events = TIMELINE
    now = time.monotonic

    atexit.register(write_timeline)
    init, handed, written, leave = (
        RequestLifecycle.__init__,
        RequestLifecycle.handed_to_engine,
        RequestLifecycle.chunk_written,
        RequestLifecycle.__aexit__,
    )

    def entered(self: Any, *args: Any) -> None:
        init(self, *args)
        events.append((self.front.entry, "entry", id(self)))

    def handed_to_engine(self: Any, *args: Any) -> None:
        handed(self, *args)
        events.append((now(), "handed", id(self)))

    def chunk_written(self: Any) -> None:
        first = not self.front.first_chunk_written
        written(self)
        if first and self.front.first_chunk_written:
            events.append((now(), "first", id(self)))

    async def left(self: Any, *args: Any) -> None:
        await leave(self, *args)
        events.append((now(), "end", id(self)))

    RequestLifecycle.__init__ = entered  # type: ignore[method-assign,assignment]
    RequestLifecycle.handed_to_engine = handed_to_engine  # type: ignore[method-assign,assignment]
    RequestLifecycle.chunk_written = chunk_written  # type: ignore[method-assign]
    RequestLifecycle.__aexit__ = left  # type: ignore[method-assign,assignment]

    def timed(function: Callable[..., None], name: Callable[[Any], str]) -> Callable[..., None]:
        def run(self: Any) -> None:
            start = now()
            function(self)
            events.append((start, "hand_on", [name(self), now() - start]))

        return run

    ObserverGroup.hand_on = timed(ObserverGroup.hand_on, lambda self: "records")  # type: ignore[method-assign]
    StepAggregator.flush_reports = timed(StepAggregator.flush_reports, lambda self: "step reports")  # type: ignore[method-assign]
    HeldPrometheusStatLogger.hand_on = timed(  # type: ignore[method-assign]
        HeldPrometheusStatLogger.hand_on, lambda self: "vLLM's series"
    )


def _made_in_the_engine_core() -> None:
    """Nothing in the server's own process (the cut is made when the engine core imports this module, below)."""


def named_cuts() -> list[str]:
    """The cuts `PHASESCOPE_WHAT_IF` names, in its order."""
    return [cut for cut in os.environ.get("PHASESCOPE_WHAT_IF", "").split(",") if cut]


def apply_cuts() -> None:
    """Make the cuts `PHASESCOPE_WHAT_IF` names in this process (another study's runner may call it too)."""
    cuts = named_cuts()
    unknown = sorted(set(cuts) - set(CUTS))
    if unknown:
        sys.exit(f"PHASESCOPE_WHAT_IF: unknown {', '.join(unknown)} (known: {', '.join(CUTS)})")
    patches: dict[str, Callable[[], None]] = {
        "no-step-telemetry": _no_step_telemetry,
        "no-step-reports": _no_step_reports,
        "bare-took": _bare_took,
        "no-request-records": _no_request_records,
        "no-status-interceptor": _no_status_interceptor,
        "no-engine-mfu": _no_engine_mfu,
        "no-engine-step-details": _no_engine_step_details,
        "engine-core-blocks": _made_in_the_engine_core,
        "switch-1ms": _switch_1ms,
        "timeline": _timeline,
    }
    for cut in cuts:
        patches[cut]()
    print(f"front_end_what_if: cut {', '.join(cuts) or 'nothing'}", file=sys.stderr, flush=True)


def main() -> int:
    apply_cuts()
    from phasescope.cli.main import main as phasescope_main

    return phasescope_main(sys.argv[1:])


if __name__ == "__mp_main__" and "engine-core-blocks" in named_cuts():
    import multiprocessing

    if multiprocessing.current_process().name.startswith("EngineCore"):
        _engine_core_blocks()
        print(f"front_end_what_if: engine-core-blocks in {multiprocessing.current_process().name}", file=sys.stderr)

if __name__ == "__main__":
    sys.exit(main())
