"""WatchTelemetry: the request's options, and one snapshot of the server as a message.

Snapshots are built only for a watcher, when its interval comes round: nothing here runs
when nobody watches. The figures are the ones /metrics exports at the same moment (the
same `StepMetrics` window and verdicts); the requests in flight are the servicer's own.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from phasescope.errors import InvalidRequestError
from phasescope.telemetry.hardware.peaks import HardwarePeaks
from phasescope.telemetry.live import LatencyFigures
from phasescope.telemetry.request.adapters import BASE_ADAPTER
from phasescope.telemetry.request.phases import EngineTimestamps, FrontendTimestamps
from phasescope.telemetry.request.stages import DECODE, FRONTEND, PREFILL
from phasescope.telemetry.step.aggregator import EngineView
from phasescope.telemetry.step.interference import Interference
from phasescope.v1 import inference_pb2 as pb

MIN_INTERVAL_SECONDS = 0.25
MAX_INTERVAL_SECONDS = 60.0
DEFAULT_INTERVAL_SECONDS = 1.0
DEFAULT_MAX_REQUESTS = 32
MAX_REQUESTS = 1000


@dataclass(frozen=True, slots=True)
class WatchOptions:
    interval_seconds: float
    max_requests: int
    newest_first: bool


def watch_options(request: pb.WatchTelemetryRequest) -> WatchOptions:
    """The request's options with defaults filled in; InvalidRequestError names a field out of range."""
    interval = request.interval_seconds or DEFAULT_INTERVAL_SECONDS
    if not MIN_INTERVAL_SECONDS <= interval <= MAX_INTERVAL_SECONDS:
        raise InvalidRequestError(
            "interval_seconds",
            f"must be between {MIN_INTERVAL_SECONDS} and {MAX_INTERVAL_SECONDS} seconds (0 means "
            f"{DEFAULT_INTERVAL_SECONDS}), got {request.interval_seconds}",
        )
    if request.max_requests > MAX_REQUESTS:
        raise InvalidRequestError("max_requests", f"must be at most {MAX_REQUESTS}, got {request.max_requests}")
    count = 0 if request.omit_requests else (request.max_requests or DEFAULT_MAX_REQUESTS)
    return WatchOptions(interval, count, request.request_order == pb.REQUEST_ORDER_NEWEST_FIRST)


class InFlight(Protocol):
    """What the request path knows of a request while it runs (its `RequestLifecycle`)."""

    request_id: str
    prompt_tokens: int
    front: FrontendTimestamps
    adapter: str
    """Its adapter label (phasescope.telemetry.request.adapters)."""

    @property
    def cached_prompt_tokens(self) -> int: ...

    @property
    def completion_tokens(self) -> int: ...

    @property
    def stamps(self) -> EngineTimestamps | None: ...

    @property
    def interference(self) -> Interference: ...


class TelemetrySource(Protocol):
    """The engine-side figures: `phasescope.serve.build.LiveTelemetry` wires the step aggregator's views and
    RecentLatencies behind it."""

    def views(self) -> tuple[float, list[EngineView]]: ...

    def latencies(self, window_seconds: float) -> LatencyFigures: ...

    @property
    def rejected(self) -> int: ...


def request_snapshot(trace: InFlight, now: float) -> pb.RequestSnapshot:
    """One request in flight, on the monotonic clock its stamps use (`now` = time.monotonic())."""
    stamps = trace.stamps
    first_token = stamps.first_token_ts if stamps is not None else 0.0
    if not trace.front.handed_to_engine:
        phase = FRONTEND.name
    elif first_token <= 0.0:
        # The engine stamps nothing before the first token: queued and prefilling look alike.
        phase = PREFILL.name
    else:
        phase = DECODE.name
    decoded = trace.completion_tokens - 1
    last_token = stamps.last_token_ts if stamps is not None else 0.0
    rate = decoded / (last_token - first_token) if decoded >= 1 and last_token > first_token else 0.0
    return pb.RequestSnapshot(
        request_id=trace.request_id,
        phase=phase,
        age_seconds=max(0.0, now - trace.front.entry),
        prompt_tokens=trace.prompt_tokens,
        completion_tokens=trace.completion_tokens,
        tokens_per_second=rate,
        decode_stalled_by_prefill_seconds=trace.interference.stalled_seconds,
        decode_prefill_interference_seconds=trace.interference.extra_seconds,
        adapter=trace.adapter,
    )


def _engine_snapshot(view: EngineView) -> pb.EngineSnapshot:
    message = pb.EngineSnapshot(
        engine=view.engine,
        memory_bandwidth_utilization=view.device.memory_bandwidth_utilization,
        compute_utilization=view.device.compute_utilization,
        compute_idle=view.device.compute_idle,
        busy_ratio=view.device.busy_ratio,
        running=view.running,
        waiting=view.waiting,
        kv_cache_usage=view.kv_cache_usage,
        queue_wait_ratio=view.queue_share,
        headroom=view.headroom.ratio,
        headroom_limit=view.headroom.limit,
        idle_cost_per_hour=view.idle_cost_per_hour or 0.0,
        has_cost=view.idle_cost_per_hour is not None,
        kv_cache_capacity_tokens=view.kv_cache_capacity_tokens,
        kv_cache_tokens=view.kv_cache_tokens,
        kv_cache_sequences_fit=view.sequences_fit or 0.0,
        waiting_for_kv_cache=view.waiting - view.waiting_for_adapters if view.waiting_reason == "kv_cache" else 0,
        waiting_for_slot=view.waiting - view.waiting_for_adapters if view.waiting_reason == "slot" else 0,
        waiting_for_adapters=view.waiting_for_adapters,
        kv_cache_wait_ratio=(view.wait_shares or {}).get("kv_cache", 0.0),
        preemptions_in_window=view.preemptions,
    )
    if view.speculation is not None:
        message.speculative_acceptance_rate = view.speculation.acceptance_rate
        message.speculative_mean_acceptance_length = view.speculation.mean_acceptance_length
        message.speculative_gain = view.speculation.gain or 0.0
        message.speculative_reading = view.speculation.reading or ""
    for phase, phase_view in view.phases.items():
        figures = phase_view.figures
        message.phases.append(
            pb.PhaseSnapshot(
                phase=phase,
                tokens_per_second=figures.tokens_per_second,
                memory_bandwidth_utilization=figures.memory_bandwidth_utilization or 0.0,
                compute_utilization=figures.compute_utilization or 0.0,
                arithmetic_intensity=figures.arithmetic_intensity or 0.0,
                batch_size=figures.batch_size or 0.0,
                verdict=phase_view.verdict.verdict,
                host_overhead=phase_view.verdict.host_overhead or 0.0,
                cost_per_million_tokens=phase_view.cost_per_million_tokens or 0.0,
                ran=figures.memory_bandwidth_utilization is not None,
            )
        )
    return message


@dataclass(frozen=True, slots=True)
class ServerFacts:
    """What does not change while the server runs."""

    model_name: str
    device: str
    dtype: str
    peaks: HardwarePeaks
    started_monotonic: float


def build_snapshot(
    facts: ServerFacts,
    source: TelemetrySource,
    in_flight: Sequence[InFlight],
    admission: tuple[int, int],
    rejected_in_interval: int,
    options: WatchOptions,
) -> pb.TelemetrySnapshot:
    now = time.monotonic()
    window, views = source.views()
    latency = source.latencies(window)
    peaks = facts.peaks
    bandwidth = peaks.memory_bandwidth_bytes_per_second
    flops = peaks.peak_flops(facts.dtype)
    snapshot = pb.TelemetrySnapshot(
        time_unix_seconds=time.time(),
        window_seconds=window,
        model_name=facts.model_name,
        uptime_seconds=now - facts.started_monotonic,
        device=facts.device,
        peaks=pb.Peaks(
            memory_bandwidth_bytes_per_second=bandwidth,
            flops_per_second=flops,
            dtype=facts.dtype,
            source=peaks.source,
            hardware=peaks.description or peaks.device,
            ridge_point_flops_per_byte=flops / bandwidth,
        ),
        admission=pb.AdmissionSnapshot(
            in_flight=admission[0], capacity=admission[1], rejected_in_interval=rejected_in_interval
        ),
        latency=pb.LatencySnapshot(
            time_to_first_token_p50_seconds=latency.time_to_first_token_p50,
            time_to_first_token_p99_seconds=latency.time_to_first_token_p99,
            time_to_first_token_samples=latency.time_to_first_token_samples,
            inter_token_p50_seconds=latency.inter_token_p50,
            inter_token_p99_seconds=latency.inter_token_p99,
            inter_token_samples=latency.inter_token_samples,
            queue_mean_seconds=latency.queue_mean,
            prefill_mean_seconds=latency.prefill_mean,
            decode_mean_seconds=latency.decode_mean,
            kv_transfer_mean_seconds=latency.kv_transfer_mean,
        ),
        requests_in_flight=len(in_flight),
    )
    snapshot.engines.extend(_engine_snapshot(view) for view in views)
    if options.max_requests:
        ordered: Iterable[InFlight] = sorted(
            in_flight, key=lambda trace: trace.front.entry, reverse=options.newest_first
        )
        snapshot.requests.extend(request_snapshot(trace, now) for trace in list(ordered)[: options.max_requests])
    snapshot.adapters.extend(adapter_snapshots(in_flight, now))
    return snapshot


def adapter_snapshots(in_flight: Sequence[InFlight], now: float) -> list[pb.AdapterSnapshot]:
    """The requests in flight by adapter label, when any runs with an adapter (base first, then by name)."""
    if all(trace.adapter == BASE_ADAPTER for trace in in_flight):
        return []
    rows: dict[str, pb.AdapterSnapshot] = {}
    for trace in in_flight:
        row = rows.setdefault(trace.adapter, pb.AdapterSnapshot(adapter=trace.adapter))
        snapshot = request_snapshot(trace, now)
        row.in_flight += 1
        if snapshot.phase == DECODE.name:
            row.decoding += 1
            row.tokens_per_second += snapshot.tokens_per_second
    return [rows[name] for name in sorted(rows, key=lambda name: (name != BASE_ADAPTER, name))]
