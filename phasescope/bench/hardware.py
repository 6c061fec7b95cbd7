"""The server's account of a run's window, from its /metrics: what the hardware did at that load.

Two kinds of figures:
- **counter deltas** over exactly the run (`server_view`): tokens/s per phase, bandwidth
  saturation (MBU) and compute utilisation (MFU) per phase and for the device, compute
  idleness, mean phase times per request; and speculative decoding's acceptance
  (`speculative_view`), from phasescope's counters or vLLM's own, on any server that exports them;
- **gauges sampled during the run** (`MetricsSampler`, `gauge_view`) for what the server only
  exports as a current value: the verdict per phase (`phasescope_bound`), host overhead,
  headroom and its binding limit, queue-wait share and KV-cache usage. The verdict, host
  overhead, headroom and queue-wait gauges cover the server's sliding window
  (`--metrics-window-seconds`, 10 s by default) ending at each sample, so samples in a run's
  first window also see the time before it; KV-cache usage and the scheduler's queue are
  instantaneous. A run reports the most frequent verdict, the mean and extreme of the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import statistics
import urllib.request
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from phasescope.bench.spread import most_frequent
from phasescope.telemetry.exposition import Samples, fetch_samples, sum_samples
from phasescope.telemetry.request.stages import ANSWERED

logger = logging.getLogger(__name__)

SAMPLE_INTERVAL_SECONDS = 2.0
"""How often a run reads /metrics by default (`bench --scrape-interval`): the gauges move with the server's
10 s window, and a read costs the server CPU (docs/benchmarks.md, "What the telemetry costs"), which is why
every target with a /metrics is read on the same cadence."""
PHASES = ("prefill", "decode")


def server_view(before: Samples, after: Samples, duration: float) -> dict[str, float]:
    """The server's own account of the same window, from counter deltas."""

    def delta(name: str, **labels: str) -> float:
        return sum_samples(after, name, **labels) - sum_samples(before, name, **labels)

    view: dict[str, float] = {}
    for stage in ANSWERED:
        count = delta("phasescope_request_phase_seconds_count", phase=stage.name)
        total = delta("phasescope_request_phase_seconds_sum", phase=stage.name)
        view[f"server_mean_{stage.name}_ms"] = total / count * 1e3 if count else 0.0
    view["server_requests_without_first_token"] = delta("phasescope_requests_without_first_token_total")
    peak_bandwidth = sum_samples(after, "phasescope_hardware_peak_memory_bandwidth_bytes_per_second")
    peak_flops = sum_samples(after, "phasescope_hardware_peak_flops_per_second")
    # Over the point's wall time, per engine average (peaks are per engine).
    engines = max(1, len({dict(ls).get("engine") for (n, ls) in after if n == "phasescope_engine_requests"}))

    def bandwidth_saturation(moved: float) -> float:
        return moved / duration / engines / peak_bandwidth if peak_bandwidth else 0.0

    def compute_utilization(flops: float) -> float:
        return flops / duration / engines / peak_flops if peak_flops else 0.0

    device_moved = device_flops = 0.0
    for phase in PHASES:
        view[f"server_{phase}_tokens_per_second"] = delta("phasescope_tokens_total", phase=phase) / duration
        moved = delta("phasescope_model_read_bytes_total", phase=phase) + delta(
            "phasescope_model_written_bytes_total", phase=phase
        )
        flops = delta("phasescope_model_flops_total", phase=phase)
        device_moved, device_flops = device_moved + moved, device_flops + flops
        # Each phase's part of the device's figures (docs/metrics.md).
        view[f"server_{phase}_bandwidth_saturation"] = bandwidth_saturation(moved)
        view[f"server_{phase}_compute_utilization"] = compute_utilization(flops)
    view["server_device_bandwidth_saturation"] = bandwidth_saturation(device_moved)
    view["server_device_compute_utilization"] = compute_utilization(device_flops)
    # Compute idleness is the device's: 1 − MFU of all steps.
    view["server_device_compute_idleness"] = 1.0 - compute_utilization(device_flops)
    # What phasescope's accounting cost the engine loop: per engine-core step, and as a share of the steps' time.
    hook_seconds = delta("phasescope_engine_telemetry_hook_seconds_total")
    hook_calls = delta("phasescope_engine_telemetry_hook_calls_total")
    busy_seconds = sum(delta("phasescope_engine_busy_seconds_total", phase=phase) for phase in PHASES)
    view["server_engine_hook_us_per_step"] = hook_seconds / hook_calls * 1e6 if hook_calls else 0.0
    view["server_engine_hook_share_of_busy"] = hook_seconds / busy_seconds if busy_seconds else 0.0
    return view


SPECULATIVE_SERIES = (
    ("phasescope_speculative_drafts_total", "phasescope_speculative_drafted_tokens_total",
     "phasescope_speculative_accepted_tokens_total"),
    ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
     "vllm:spec_decode_num_accepted_tokens_total"),
)  # fmt: skip
"""Speculative decoding's counters (drafts, drafted tokens, accepted tokens), summed over `model` and `engine`:
phasescope's, else vLLM's own (its OpenAI server's, or its gRPC worker's /metrics when it has one)."""


def speculative_view(before: Samples, after: Samples) -> dict[str, float]:
    """Speculative decoding over the run, from counter deltas: `speculative_drafted_tokens`,
    `speculative_acceptance_rate` = accepted ÷ drafted and `speculative_mean_acceptance_length` = 1 + accepted ÷
    drafts (tokens a sequence emits per verify step). Nothing when the server exports neither set of counters
    (no speculation, or a server that does not count it), and no ratio when the run drafted nothing: an absent
    figure, never a 0 that reads as a measurement. A series missing from `before` but present after was created
    during the run (a labelled counter appears at its first increment): it counts from 0."""
    exported = {name for name, _ in after}
    names = next((series for series in SPECULATIVE_SERIES if set(series) <= exported), None)
    if names is None:
        return {}
    drafts, drafted, accepted = (sum_samples(after, name) - sum_samples(before, name) for name in names)
    view: dict[str, float] = {"speculative_drafted_tokens": round(drafted)}
    if drafts > 0 and drafted > 0:
        view["speculative_acceptance_rate"] = accepted / drafted
        view["speculative_mean_acceptance_length"] = 1.0 + accepted / drafts
    return view


@dataclass
class GaugeSnapshot:
    """One reading of the window gauges, over every engine."""

    verdicts: dict[str, list[str]] = field(default_factory=dict)
    """Per phase, the verdict each engine reports (its `phasescope_bound` series at 1)."""
    host_overhead_ratio: dict[str, float] = field(default_factory=dict)
    """Per phase, the mean over the engines that ran it."""
    headroom_ratio: float | None = None
    """The smallest over the engines: the engine that binds first."""
    headroom_limit: str = ""
    queue_wait_ratio: float = 0.0
    kv_cache_usage_ratio: float = 0.0
    """The largest over the engines."""
    running_requests: float = 0.0
    waiting_requests: float = 0.0


def gauge_snapshot(samples: Samples) -> GaugeSnapshot:
    snapshot = GaugeSnapshot()
    overheads: dict[str, list[float]] = {}
    queue_waits, kv_usages = [], []
    for (name, label_set), value in samples.items():
        labels = dict(label_set)
        if name == "phasescope_bound" and value == 1:
            snapshot.verdicts.setdefault(labels["phase"], []).append(labels["verdict"])
        elif name == "phasescope_host_overhead_ratio":
            overheads.setdefault(labels["phase"], []).append(value)
        elif name == "phasescope_headroom_ratio" and (
            snapshot.headroom_ratio is None or value < snapshot.headroom_ratio
        ):
            snapshot.headroom_ratio, snapshot.headroom_limit = value, labels.get("limit", "")
        elif name == "phasescope_queue_wait_ratio":
            queue_waits.append(value)
        elif name == "phasescope_kv_cache_usage_ratio":
            kv_usages.append(value)
    snapshot.host_overhead_ratio = {phase: statistics.fmean(values) for phase, values in overheads.items()}
    snapshot.queue_wait_ratio = max(queue_waits, default=0.0)
    snapshot.kv_cache_usage_ratio = max(kv_usages, default=0.0)
    snapshot.running_requests = sum_samples(samples, "phasescope_engine_requests", state="running")
    snapshot.waiting_requests = sum_samples(samples, "phasescope_engine_requests", state="waiting")
    return snapshot


def gauge_view(snapshots: list[GaugeSnapshot]) -> dict[str, Any]:
    """A run's gauges: the most frequent verdict per phase, means and extremes of the ratios."""
    if not snapshots:
        return {}
    view: dict[str, Any] = {"server_gauge_samples": len(snapshots)}
    for phase in PHASES:
        verdicts = [v for s in snapshots for v in s.verdicts.get(phase, [])]
        if verdicts:
            view[f"server_{phase}_verdict"] = most_frequent(verdicts)
        overheads = [s.host_overhead_ratio[phase] for s in snapshots if phase in s.host_overhead_ratio]
        if overheads:
            view[f"server_{phase}_host_overhead_ratio"] = statistics.fmean(overheads)
    headrooms = [s for s in snapshots if s.headroom_ratio is not None]
    if headrooms:
        view["server_headroom_ratio"] = statistics.fmean(s.headroom_ratio or 0.0 for s in headrooms)
        view["server_min_headroom_ratio"] = min(s.headroom_ratio or 0.0 for s in headrooms)
        view["server_headroom_limit"] = most_frequent([s.headroom_limit for s in headrooms])
    view["server_queue_wait_ratio"] = statistics.fmean(s.queue_wait_ratio for s in snapshots)
    view["server_max_queue_wait_ratio"] = max(s.queue_wait_ratio for s in snapshots)
    view["server_kv_cache_usage_ratio"] = statistics.fmean(s.kv_cache_usage_ratio for s in snapshots)
    view["server_max_kv_cache_usage_ratio"] = max(s.kv_cache_usage_ratio for s in snapshots)
    view["server_mean_running_requests"] = statistics.fmean(s.running_requests for s in snapshots)
    view["server_max_waiting_requests"] = max(s.waiting_requests for s in snapshots)
    return view


def _read_exposition(url: str, timeout: float) -> None:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        response.read()


class MetricsSampler:
    """Reads /metrics every `interval` seconds while a run lasts (in a thread: the event loop times the run),
    and once more as it ends; `interval` 0: only that last read.

    `gauges=False` reads and discards (another server's /metrics, read on the same cadence so that every
    server pays for its own exposition in its front-end CPU, as a Prometheus scraping all of them would).
    """

    def __init__(self, url: str, interval: float = SAMPLE_INTERVAL_SECONDS, *, gauges: bool = True) -> None:
        self._url = url
        self._interval = interval
        self._gauges = gauges
        self._task: asyncio.Task[None] | None = None
        self.snapshots: list[GaugeSnapshot] = []
        self.reads = 0

    async def _read(self) -> None:
        try:
            if self._gauges:
                self.snapshots.append(gauge_snapshot(await asyncio.to_thread(fetch_samples, self._url, 5.0)))
            else:
                await asyncio.to_thread(_read_exposition, self._url, 5.0)
            self.reads += 1
        except OSError as exc:  # a missed reading thins the sample, it does not stop the run
            logger.warning("reading %s failed: %s", self._url, exc)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            await self._read()

    async def __aenter__(self) -> MetricsSampler:
        if self._interval > 0:
            self._task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if kind is None:
            # The window that ends with the run.
            await self._read()
