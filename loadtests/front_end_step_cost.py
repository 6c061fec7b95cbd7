"""The CPU a serving front end spends per engine step and per streamed token, measured inside the running server.

A `timeit` loop runs the step telemetry with every cache warm: 21 µs a step at batch 16. Inside a
server under load the same code runs between the gRPC core, the output processor and the event
loop, and costs several times that. This runs a server module (phasescope's `serve`, or vLLM's
gRPC worker) with a few methods timed by the thread's CPU clock, and prints on exit, per method,
its calls, microseconds per call and seconds in all:

    .venv/bin/python -m loadtests.front_end_step_cost phasescope serve --model DIR --enforce-eager ...
    .venv/bin/python -m loadtests.front_end_step_cost vllm.entrypoints.launchers.grpc_server --model DIR ...

then load it with `phasescope bench --vllm-grpc-address 127.0.0.1:PORT --model DIR ...` and stop it
(SIGTERM or Ctrl-C; a SIGUSR1 once it is up leaves start-up out of the report). Timed: vLLM's
`OutputProcessor.process_outputs` and `StatLoggerManager.record` (every stat logger of a step), its
`PrometheusStatLogger.record` (in phasescope, each held update as it is handed on:
`phasescope.engine.vllm.stats.HeldPrometheusStatLogger`), and where phasescope runs,
`PhasescopeStatLogger.record` (its whole step telemetry) and `RequestLifecycle.took` (once per
request per step), and every garbage collection by generation (in either server). Each timer reads
the clock twice, about a microsecond, so nested timers are left out: each figure is one call's whole
cost.
"""

from __future__ import annotations

import atexit
import functools
import gc
import json
import os
import runpy
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

_calls: dict[str, list[float]] = {}


def timed(owner: Any, name: str, key: str) -> None:
    """Replace `owner.name` by a wrapper adding its thread CPU seconds and calls under `key`."""
    method: Callable[..., Any] = getattr(owner, name)
    totals = _calls.setdefault(key, [0.0, 0.0])

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.thread_time()
        try:
            return method(*args, **kwargs)
        finally:
            totals[0] += 1
            totals[1] += time.thread_time() - start

    setattr(owner, name, wrapper)


def report() -> dict[str, dict[str, float]]:
    return {
        key: {"calls": int(calls), "us_per_call": round(seconds * 1e6 / calls, 1) if calls else 0.0, "seconds": seconds}
        for key, (calls, seconds) in _calls.items()
    }


def forget() -> None:
    """Start every count afresh (the timers keep their totals' lists)."""
    for totals in _calls.values():
        totals[0] = totals[1] = 0.0


def time_garbage_collections() -> None:
    """Add every garbage collection's thread CPU seconds under its generation (`gc.callbacks`)."""
    started: list[float] = []

    def on_collection(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started.append(time.thread_time())
        elif started:
            totals = _calls.setdefault(f"python gc generation {info['generation']}", [0.0, 0.0])
            totals[0] += 1
            totals[1] += time.thread_time() - started.pop()

    gc.callbacks.append(on_collection)


def install() -> None:
    time_garbage_collections()
    from vllm.v1.engine.output_processor import OutputProcessor
    from vllm.v1.metrics.loggers import PrometheusStatLogger, StatLoggerManager

    timed(OutputProcessor, "process_outputs", "vllm OutputProcessor.process_outputs")
    timed(StatLoggerManager, "record", "vllm StatLoggerManager.record (all stat loggers)")
    timed(PrometheusStatLogger, "record", "vllm PrometheusStatLogger.record")
    try:
        from phasescope.engine.vllm.stats import PhasescopeStatLogger
        from phasescope.serve.lifecycle import RequestLifecycle
    except ImportError:  # vLLM's own worker, run without phasescope installed
        return
    timed(PhasescopeStatLogger, "record", "phasescope PhasescopeStatLogger.record (step telemetry)")
    from phasescope.engine.vllm.stats import HeldPrometheusStatLogger
    from phasescope.telemetry.request.observer import ObserverGroup
    from phasescope.telemetry.step.aggregator import StepAggregator

    # The held batches, each handed on whole (a scrape's hand-on included).
    timed(StepAggregator, "flush_reports", "phasescope StepAggregator.flush_reports (held step reports)")
    timed(HeldPrometheusStatLogger, "hand_on", "phasescope HeldPrometheusStatLogger.hand_on (vLLM's series, held)")
    timed(ObserverGroup, "hand_on", "phasescope ObserverGroup.hand_on (held request records)")
    timed(RequestLifecycle, "took", "phasescope RequestLifecycle.took (per request per step)")


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: python -m loadtests.front_end_step_cost MODULE [ARGS...]")
    module, sys.argv = sys.argv[1], sys.argv[1:]
    sys.path.insert(0, os.getcwd())
    install()
    # SIGUSR1 forgets what was timed so far: sent once the server is up, the report covers the load alone.
    signal.signal(signal.SIGUSR1, lambda signum, frame: forget())
    atexit.register(lambda: print("front-end step cost:", json.dumps(report()), file=sys.stderr, flush=True))
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
