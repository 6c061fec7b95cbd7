"""The composition root's decisions about a started engine, without vLLM."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from phasescope.serve.build import build_server
from support.fake_engine import ScriptedEngine
from support.served import MODEL, settings


@pytest.mark.parametrize("pin", [False, True])
async def test_a_cpu_engine_is_judged_against_the_flags_peaks_and_pinned_only_when_asked(pin: bool) -> None:
    # In a running event loop, as a server is built (its gRPC server is made on the loop).
    built = build_server(settings(pin_front_end=pin), MODEL, registry=CollectorRegistry())
    decided = built.decide_for(ScriptedEngine())
    assert decided.peaks.memory_bandwidth_bytes_per_second == 100e9
    assert decided.peaks.source == "flag"
    assert decided.pin_front_end is pin
    assert decided.gpu_counters is None  # no GPU to sample
