"""Turns engine timings into phase figures and sends them to observers.

`telemetry` knows models, hardware and timings; it never imports `server`
or anything about gRPC.
"""

from phasescope.telemetry.request.observer import ObserverGroup, RequestObserver
from phasescope.telemetry.request.phases import EngineTimestamps, PhaseRecord, PhaseTimings, derive_phase_timings

__all__ = [
    "EngineTimestamps",
    "ObserverGroup",
    "PhaseRecord",
    "PhaseTimings",
    "RequestObserver",
    "derive_phase_timings",
]
