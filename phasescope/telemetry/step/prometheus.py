"""Prometheus export of the engine's steps: per-phase and device-level roofline figures, ITL, queue state.

A sink of the `StepAggregator` (phasescope.telemetry.step.aggregator), which owns the data.
Counters since start let any window be computed in PromQL; gauges over the
aggregator's window are computed when scraped, so an idle engine reads 0
utilisation and 1 idleness instead of its last busy value, and a phase that
ran no step in the window has no operating point (its series are absent)
instead of a misleading 0.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from phasescope.telemetry.children import Children, CounterSeries, SumCounter
from phasescope.telemetry.histograms import observe_counted
from phasescope.telemetry.step.aggregator import EngineView, StepAggregator, StepSink
from phasescope.telemetry.step.attribution import StepCost
from phasescope.telemetry.step.records import STEP_KINDS, EngineIteration, PublisherHealth, SchedulerState, StepRecord
from phasescope.telemetry.step.verdict import VERDICTS
from phasescope.telemetry.step.window import SPECULATION_READINGS, WAIT_REASONS, DeviceFigures, PhaseFigures

# Gaps between tokens: a quarter millisecond (a small model's decode step on a GPU)
# to seconds on a loaded CPU.
INTER_TOKEN_SECONDS_BUCKETS = (
    0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip


class StepMetrics(StepSink, Collector):
    """The aggregated steps as Prometheus series: counters as each report arrives, the window's
    gauges, verdicts, headroom and cost when scraped (all read from the `StepAggregator`)."""

    def __init__(self, model: str, steps: StepAggregator, adapter_label: Callable[[str], str] = str) -> None:
        """Makes its series and registers nothing: the server registers it in its registry (one collector, its
        series in the order made here) and adds it to `steps`' sinks (`phasescope.serve.build`). `adapter_label`
        names an adapter in the adapter series (the request series' bounded label)."""
        self._model = model
        self._adapter_label = adapter_label
        self._steps = steps
        self._peaks = steps.peaks
        self._dtype = steps.dtype
        engines = self._engines = steps.engines
        labels = ["model", "engine", "phase"]
        self.flops = SumCounter(
            "phasescope_model_flops",
            "Modelled FLOPs of the engine's steps on each device, per phase (the engine's estimate when it gives "
            "one, else the cost model's: 2 × active parameters per token + attention); mixed steps split in the "
            "cost model's proportion.",
            labels,
        )
        self.bytes_read = SumCounter(
            "phasescope_model_read_bytes",
            "Modelled bytes the engine's steps read from device memory, per phase (weights once per step + KV cache); "
            "in a mixed step decode pays the weights and its own KV, the prefill chunk only what it adds.",
            labels,
        )
        self.written_bytes = SumCounter(
            "phasescope_model_written_bytes",
            "Modelled bytes the engine's steps wrote to device memory (new KV entries), per phase; in a mixed step "
            "decode pays its tokens' KV, the prefill chunk the rest.",
            labels,
        )
        self.busy_seconds = SumCounter(
            "phasescope_engine_busy_seconds",
            "Seconds the engine spent executing steps, per phase (mixed steps split by each phase's roofline time).",
            labels,
        )
        self.step_tokens = SumCounter(
            "phasescope_engine_step_tokens",
            "Tokens the engine's steps processed, per phase, as the engine scheduled them (prefill chunks and "
            "recomputation after preemption count as prefill).",
            labels,
        )
        self.steps = SumCounter(
            "phasescope_engine_steps",
            "Engine steps by kind: prefill (prompt chunks only), decode (decodes only), mixed (both).",
            ["model", "engine", "kind"],
        )
        self.telemetry_dropped_reports = SumCounter(
            "phasescope_engine_telemetry_dropped_reports",
            "Step reports an engine core's publisher dropped rather than wait (its queue full, or the hub slow or "
            "gone): steps missing from every phasescope series.",
            ["model", "engine"],
        )
        self.telemetry_hook_seconds = SumCounter(
            "phasescope_engine_telemetry_hook_seconds",
            "Time the engine loop spent in phasescope's step accounting (building and queueing each step's "
            "report); ÷ phasescope_engine_telemetry_hook_calls_total is its cost per step.",
            ["model", "engine"],
        )
        self.telemetry_hook_calls = SumCounter(
            "phasescope_engine_telemetry_hook_calls",
            "Engine-core steps phasescope's step accounting ran for (steps that scheduled nothing included).",
            ["model", "engine"],
        )
        self.preemptions = SumCounter(
            "phasescope_preemptions",
            "Requests the engine preempted (KV cache full): each recomputes its tokens when resumed.",
            ["model", "engine"],
        )
        self.speculative_drafts = SumCounter(
            "phasescope_speculative_drafts",
            "Drafts the engine verified (one per sequence per verify step), under speculative decoding.",
            ["model", "engine"],
        )
        self.speculative_drafted_tokens = SumCounter(
            "phasescope_speculative_drafted_tokens",
            "Tokens the drafter proposed and the engine verified (vllm:spec_decode_num_draft_tokens).",
            ["model", "engine"],
        )
        self.speculative_accepted_tokens = SumCounter(
            "phasescope_speculative_accepted_tokens",
            "Drafted tokens the verification accepted (vllm:spec_decode_num_accepted_tokens); acceptance rate = "
            "accepted ÷ drafted, mean acceptance length = 1 + accepted ÷ drafts.",
            ["model", "engine"],
        )
        self.speculative_accepted_by_position = SumCounter(
            "phasescope_speculative_accepted_tokens_by_position",
            "Drafted tokens accepted at each draft position (0: the first drafted token); ÷ drafts is that "
            "position's acceptance.",
            ["model", "engine", "position"],
        )
        self.inter_token_latency_seconds = Histogram(
            "phasescope_inter_token_latency_seconds",
            "Each gap between consecutive output tokens of a request, from the engine core's own step "
            "timestamps (vLLM's per-step values), whatever the front end coalesced into one chunk.",
            ["model"],
            buckets=INTER_TOKEN_SECONDS_BUCKETS,
            registry=None,
        )
        self.engine_requests = Gauge(
            "phasescope_engine_requests",
            "Requests in the engine's scheduler: running (in the batch), waiting (queued for a slot) or deferred "
            "(queued but held back until their structured output's grammar is compiled).",
            ["model", "engine", "state"],
            registry=None,
        )
        self.kv_cache_usage = Gauge(
            "phasescope_kv_cache_usage_ratio",
            "Share of the engine's KV-cache blocks in use (1 = full: new sequences wait or are preempted).",
            ["model", "engine"],
            registry=None,
        )
        for engine in range(engines):
            for state in ("running", "waiting", "deferred"):
                self.engine_requests.labels(model, str(engine), state).set(0)
            self.kv_cache_usage.labels(model, str(engine)).set(0)
            self.preemptions.labels(model, str(engine))
            for kind in STEP_KINDS:
                self.steps.labels(model, str(engine), kind)
        self._inter_token = self.inter_token_latency_seconds.labels(model)
        self._child = Children()
        # Each engine's last scheduler state: most steps report the same one again, and its gauges keep it.
        self._last_queue: dict[int, SchedulerState] = {}
        self._last_publisher: dict[int, PublisherHealth] = {}
        # Each (engine, phase)'s series of flops, bytes_read, written_bytes, busy_seconds and step_tokens.
        self._phase_series: dict[tuple[str, str], tuple[CounterSeries, ...]] = {}
        # What `collect` yields before the window's figures, in this order.
        self.adapter_flops = SumCounter(
            "phasescope_adapter_flops",
            "Modelled FLOPs of each LoRA adapter on each device: 2 × rank × (inputs + outputs) of every adapted "
            "projection, per token of its sequences (counted in phasescope_model_flops too).",
            ["model", "adapter"],
        )
        self.adapter_read_bytes = SumCounter(
            "phasescope_adapter_read_bytes",
            "Modelled bytes each LoRA adapter's matrices cost on each device: every A and B once per step that ran "
            "one of its sequences (counted in phasescope_model_read_bytes too).",
            ["model", "adapter"],
        )
        self.adapter_steps = SumCounter(
            "phasescope_adapter_steps",
            "Engine steps that ran at least one sequence of each LoRA adapter.",
            ["model", "adapter"],
        )
        self.adapter_busy_seconds = SumCounter(
            "phasescope_adapter_busy_seconds",
            "Each LoRA adapter's share of the engine's step time: every step that ran it shared between its "
            "sequences by their tokens (the adapter's matrices and kernels included in the step's time).",
            ["model", "adapter"],
        )
        self.adapter_cost = SumCounter(
            "phasescope_adapter_cost",
            "What each LoRA adapter's share of the step time cost at --accelerator-cost-per-hour (absent without a "
            "price): rate() of it ÷ rate() of its tokens is its cost per token.",
            ["model", "adapter"],
        )
        self._series: tuple[Collector, ...] = (
            self.flops,
            self.bytes_read,
            self.written_bytes,
            self.busy_seconds,
            self.step_tokens,
            self.steps,
            self.telemetry_dropped_reports,
            self.telemetry_hook_seconds,
            self.telemetry_hook_calls,
            self.preemptions,
            self.speculative_drafts,
            self.speculative_drafted_tokens,
            self.speculative_accepted_tokens,
            self.speculative_accepted_by_position,
            self.inter_token_latency_seconds,
            self.engine_requests,
            self.kv_cache_usage,
            self.adapter_flops,
            self.adapter_read_bytes,
            self.adapter_steps,
            self.adapter_busy_seconds,
            self.adapter_cost,
        )

    def _count_adapters(self, step: StepRecord, cost: StepCost) -> None:
        """Each adapter's part of the step, as the attribution charged it (`attribution.adapter_work`), and its share
        of the step's time (and price) by its sequences' tokens."""
        step_tokens = step.prefill_tokens + step.decode_tokens
        cost_per_hour = self._steps.cost_per_hour
        for charge in cost.adapters.each:
            label = self._adapter_label(charge.name)
            self.adapter_flops.inc(charge.flops, self._model, label)
            self.adapter_read_bytes.inc(charge.read_bytes, self._model, label)
            self.adapter_steps.inc(1, self._model, label)
            busy = step.elapsed_seconds * charge.tokens / step_tokens
            self.adapter_busy_seconds.inc(busy, self._model, label)
            if cost_per_hour is not None:
                self.adapter_cost.inc(busy * cost_per_hour / 3600.0, self._model, label)

    def queue(self, state: SchedulerState) -> None:
        if self._last_queue.get(state.engine) == state:
            return
        self._last_queue[state.engine] = state
        labels = (self._model, str(state.engine))
        self._child(self.engine_requests, *labels, "running").set(state.running)
        self._child(self.engine_requests, *labels, "waiting").set(state.waiting)
        self._child(self.engine_requests, *labels, "deferred").set(state.deferred)
        self._child(self.kv_cache_usage, *labels).set(state.kv_cache_usage)

    def publisher(self, health: PublisherHealth) -> None:
        # The publisher's figures are cumulative since its engine core started (a restarted core starts again at 0).
        last = self._last_publisher.get(health.engine)
        self._last_publisher[health.engine] = health
        labels = (self._model, str(health.engine))
        for counter, now, before in (
            (self.telemetry_dropped_reports, health.dropped_reports, last.dropped_reports if last else 0),
            (self.telemetry_hook_seconds, health.hook_seconds, last.hook_seconds if last else 0.0),
            (self.telemetry_hook_calls, health.hook_calls, last.hook_calls if last else 0),
        ):
            counter.inc(now - before if now >= before else now, *labels)

    def iteration(self, iteration: EngineIteration, at: float | None = None) -> None:
        # A step's gaps observed together (each run of requests with one gap, and its length).
        observe_counted(self._inter_token, iteration.inter_token_seconds, iteration.gap_counts())
        if iteration.preemptions:
            self.preemptions.inc(iteration.preemptions, self._model, str(iteration.engine))

    def step(self, step: StepRecord, cost: StepCost) -> None:
        engine = str(step.engine)
        self.steps.inc(1, self._model, engine, step.kind)
        for phase, share in cost.shares.items():
            if share.tokens == 0:
                continue
            try:
                series = self._phase_series[(engine, phase)]
            except KeyError:
                labels = (self._model, engine, phase)
                series = self._phase_series[(engine, phase)] = (
                    self.flops.labels(*labels),
                    self.bytes_read.labels(*labels),
                    self.written_bytes.labels(*labels),
                    self.busy_seconds.labels(*labels),
                    self.step_tokens.labels(*labels),
                )
            flops, read_bytes, written_bytes, busy_seconds, tokens = series
            flops.inc(share.flops)
            read_bytes.inc(share.read_bytes)
            written_bytes.inc(share.written_bytes)
            busy_seconds.inc(share.seconds)
            tokens.inc(share.tokens)
        if cost.adapters.each:
            self._count_adapters(step, cost)
        if (speculative := step.speculative) is not None:
            model = self._model
            self.speculative_drafts.inc(speculative.drafts, model, engine)
            self.speculative_drafted_tokens.inc(speculative.drafted_tokens, model, engine)
            self.speculative_accepted_tokens.inc(speculative.accepted_tokens, model, engine)
            for position, accepted in enumerate(speculative.accepted_by_position):
                self.speculative_accepted_by_position.inc(accepted, model, engine, str(position))

    def describe(self) -> Iterator[Metric]:
        """Every family it exports, by name, for a registry's checks and its filtered scrapes (`name[]`): what a
        scrape collects now (a registry that describes automatically reads the same)."""
        return self.collect()

    def collect(self) -> Iterator[Metric]:
        self._steps.hand_on()
        for series in self._series:
            yield from series.collect()
        window_of_steps = self._steps.window
        phases, devices = window_of_steps.figures()
        window = f"over the last {window_of_steps.window_seconds:g} s of engine steps"
        labels = ["model", "engine", "phase"]
        tokens_per_second = GaugeMetricFamily(
            "phasescope_tokens_per_second",
            f"Tokens produced per second per phase {window} (decode: emitted tokens, drafts rejected under "
            "speculative decoding left out).",
            labels=labels,
        )
        computed_per_second = GaugeMetricFamily(
            "phasescope_computed_tokens_per_second",
            f"Positions computed per second per phase {window}: phasescope_tokens_per_second plus, under "
            "speculative decoding, the drafts the verify steps rejected.",
            labels=labels,
        )
        bandwidth = GaugeMetricFamily(
            "phasescope_memory_bandwidth_utilization_ratio",
            "This phase's part of the device's bandwidth saturation: its bytes moved (read + written) per "
            f"second ÷ peak bytes/s, {window}; absent when no step carried the phase.",
            labels=labels,
        )
        compute = GaugeMetricFamily(
            "phasescope_compute_utilization_ratio",
            f"This phase's part of the device's FLOP/s ÷ peak FLOP/s (MFU), {window}; absent when no step "
            "carried the phase.",
            labels=labels,
        )
        intensity = GaugeMetricFamily(
            "phasescope_arithmetic_intensity_flops_per_byte",
            f"FLOPs per byte moved by this phase (its operating point on the roofline), {window}; absent when no "
            "step carried the phase.",
            labels=labels,
        )
        batch = GaugeMetricFamily(
            "phasescope_decode_batch_size",
            "Mean number of sequences per step that carried decode, over the window (0 when none did).",
            labels=["model", "engine"],
        )
        for (engine, phase), figures in phases.items():
            values = [self._model, str(engine), phase]
            tokens_per_second.add_metric(values, figures.tokens_per_second)
            computed_per_second.add_metric(values, figures.computed_tokens_per_second)
            if figures.memory_bandwidth_utilization is not None:
                bandwidth.add_metric(values, figures.memory_bandwidth_utilization)
            if figures.compute_utilization is not None:
                compute.add_metric(values, figures.compute_utilization)
            if figures.arithmetic_intensity is not None:
                intensity.add_metric(values, figures.arithmetic_intensity)
            if phase == "decode":
                batch.add_metric([self._model, str(engine)], figures.batch_size or 0.0)
        yield from (tokens_per_second, computed_per_second, bandwidth, compute, intensity, batch)
        yield from self._device_families(devices, window)
        yield from self._answer_families(phases, devices)
        agreement = window_of_steps.agreement()
        if agreement:
            family = GaugeMetricFamily(
                "phasescope_cost_model_agreement_ratio",
                "The project's cost model ÷ the engine's own estimate over the window (1 = they agree).",
                labels=["model", "quantity"],
            )
            for quantity, ratio in agreement.items():
                family.add_metric([self._model, quantity], ratio)
            yield family
        yield from self._peak_families()

    def _answer_families(
        self, phases: dict[tuple[int, str], PhaseFigures], devices: dict[int, DeviceFigures]
    ) -> Iterator[Metric]:
        """The verdict per phase, headroom per engine and cost per token (phasescope.telemetry.step.verdict)."""
        bound = GaugeMetricFamily(
            "phasescope_bound",
            "What bounds the phase over the window: 1 for the current verdict (memory, compute, host, queue, "
            "idle, capacity), 0 for the others (docs/metrics.md, reading the verdict).",
            labels=["model", "engine", "phase", "verdict"],
        )
        overhead = GaugeMetricFamily(
            "phasescope_host_overhead_ratio",
            "1 − the roofline's predicted step time ÷ the measured step time for the phase's work over the window: "
            "the share of step time the device's peaks do not explain; absent when no step carried the phase.",
            labels=["model", "engine", "phase"],
        )
        queue = GaugeMetricFamily(
            "phasescope_queue_wait_ratio",
            "Share of the request time in the engine spent waiting to be scheduled, for any reason (waiting ÷ "
            "waiting + running, time-weighted) over the window.",
            labels=["model", "engine"],
        )
        waits = GaugeMetricFamily(
            "phasescope_queue_wait_by_reason_ratio",
            "The same share split by why the requests waited: kv_cache (a slot free, the KV cache full or a "
            "request preempted for blocks), slot (the batch at max_num_seqs) or other (the step's token budget).",
            labels=["model", "engine", "reason"],
        )
        waiting_now = GaugeMetricFamily(
            "phasescope_engine_waiting_requests",
            "Requests waiting in the engine's queue now (vLLM's num_requests_waiting_by_reason capacity), by why "
            "they wait: kv_cache, slot or other (the same rule as phasescope_queue_wait_by_reason_ratio).",
            labels=["model", "engine", "reason"],
        )
        kv_capacity = GaugeMetricFamily(
            "phasescope_kv_cache_capacity_tokens",
            "Tokens the engine's KV cache holds: vLLM's num_gpu_blocks × block_size (the two labels of "
            "vllm:cache_config_info), per engine.",
            labels=["model", "engine"],
        )
        kv_used = GaugeMetricFamily(
            "phasescope_kv_cache_tokens",
            "Tokens of KV cache in use now: the engine's cache usage × its capacity.",
            labels=["model", "engine"],
        )
        sequences_fit = GaugeMetricFamily(
            "phasescope_kv_cache_sequences_fit",
            "Sequences the KV cache holds at the window's mean context: the running sequence-seconds ÷ the "
            "cache-share-seconds they used, over the window; absent when nothing ran in it.",
            labels=["model", "engine"],
        )
        preempted = GaugeMetricFamily(
            "phasescope_preemptions_in_window",
            "Requests the engine preempted for KV-cache blocks over the window (phasescope_preemptions_total "
            "counts them all).",
            labels=["model", "engine"],
        )
        room = GaugeMetricFamily(
            "phasescope_headroom_ratio",
            "How much more load the engine can take before its nearest limit (the limit label: bandwidth, compute, "
            "kv_cache or queue, each set by --headroom-*): 1 − used ÷ limit of the binding one, over the window.",
            labels=["model", "engine", "limit"],
        )
        per_million = GaugeMetricFamily(
            "phasescope_cost_per_million_tokens",
            "The engine's price over the window (--accelerator-cost-per-hour) shared between the phases by busy "
            "time, per million of each phase's tokens; absent without a price or tokens.",
            labels=["model", "engine", "phase"],
        )
        idle_cost = GaugeMetricFamily(
            "phasescope_idle_cost_per_hour",
            "The engine's price per hour × its compute idleness (1 − MFU) over the window: what is paid for unused "
            "compute; absent without --accelerator-cost-per-hour.",
            labels=["model", "engine"],
        )
        views = self._steps.views_of(phases, devices)
        for view in views:
            labels = [self._model, str(view.engine)]
            queue.add_metric(labels, view.queue_share)
            for reason in WAIT_REASONS:
                waits.add_metric([*labels, reason], (view.wait_shares or {}).get(reason, 0.0))
                waiting_now.add_metric([*labels, reason], _waiting_for(view, reason))
            if view.kv_cache_capacity_tokens:
                kv_capacity.add_metric(labels, view.kv_cache_capacity_tokens)
                kv_used.add_metric(labels, view.kv_cache_tokens)
            if view.sequences_fit is not None:
                sequences_fit.add_metric(labels, view.sequences_fit)
            preempted.add_metric(labels, view.preemptions)
            for phase, phase_view in view.phases.items():
                verdict = phase_view.verdict
                for name in VERDICTS:
                    bound.add_metric([*labels, phase, name], 1.0 if name == verdict.verdict else 0.0)
                if verdict.host_overhead is not None:
                    overhead.add_metric([*labels, phase], verdict.host_overhead)
                if phase_view.cost_per_million_tokens is not None:
                    per_million.add_metric([*labels, phase], phase_view.cost_per_million_tokens)
            room.add_metric([*labels, view.headroom.limit], view.headroom.ratio)
            if view.idle_cost_per_hour is not None:
                idle_cost.add_metric(labels, view.idle_cost_per_hour)
        yield from (bound, overhead, queue, room, waits, waiting_now, kv_capacity, kv_used, sequences_fit, preempted)
        if self._steps.cost_per_hour is not None:
            yield from (per_million, idle_cost)
        yield from self._speculation_families(views)

    def _speculation_families(self, views: list[EngineView]) -> Iterator[Metric]:
        """Speculative decoding over the window, per engine that verified drafts in it (docs/metrics.md)."""
        labels = ["model", "engine"]
        acceptance = GaugeMetricFamily(
            "phasescope_speculative_acceptance_ratio",
            "Accepted ÷ drafted tokens of the verify steps over the window.",
            labels=labels,
        )
        length = GaugeMetricFamily(
            "phasescope_speculative_mean_acceptance_length",
            "Tokens a sequence emits per verify step over the window: its accepted drafts and one of its own.",
            labels=labels,
        )
        useful = GaugeMetricFamily(
            "phasescope_speculative_useful_flops_ratio",
            "The emitted positions' FLOPs ÷ all decode FLOPs of the verify steps (rejected drafts and the drafter's "
            "own work are the rest), over the window.",
            labels=labels,
        )
        drafter = GaugeMetricFamily(
            "phasescope_speculative_drafter_time_ratio",
            "The drafter's share of the verify steps' decode time (its roofline share; 0 for an n-gram drafter, "
            "which runs on the host), over the window.",
            labels=labels,
        )
        gain = GaugeMetricFamily(
            "phasescope_speculative_gain_ratio",
            "Emitted tokens per second of roofline time with speculation ÷ without it for the same sequences at the "
            "same context, over the window: below 1 speculation does not pay on this device.",
            labels=labels,
        )
        reading = GaugeMetricFamily(
            "phasescope_speculative_reading",
            "1 for whether speculation pays over the window (paying; else why not: compute — the verify steps are "
            "compute-bound at this batch; acceptance — too few drafts accepted for k, or the drafter too dear), "
            "0 for the others.",
            labels=[*labels, "reading"],
        )
        for view in views:
            figures = view.speculation
            if figures is None:
                continue
            values = [self._model, str(view.engine)]
            acceptance.add_metric(values, figures.acceptance_rate)
            length.add_metric(values, figures.mean_acceptance_length)
            if (share := figures.useful_flops_share) is not None:
                useful.add_metric(values, share)
            if (time_share := figures.drafter_time_share) is not None:
                drafter.add_metric(values, time_share)
            if (ratio := figures.gain) is not None:
                gain.add_metric(values, ratio)
            if (current := figures.reading) is not None:
                for name in SPECULATION_READINGS:
                    reading.add_metric([*values, name], 1.0 if name == current else 0.0)
        yield from (acceptance, length, useful, drafter, gain, reading)

    def _device_families(self, devices: dict[int, DeviceFigures], window: str) -> Iterator[Metric]:
        labels = ["model", "engine"]
        bandwidth = GaugeMetricFamily(
            "phasescope_device_memory_bandwidth_utilization_ratio",
            f"Bandwidth saturation of the engine's device, all steps: bytes moved per second ÷ peak bytes/s, {window}.",
            labels=labels,
        )
        compute = GaugeMetricFamily(
            "phasescope_device_compute_utilization_ratio",
            f"MFU of the engine's device, all steps: FLOP/s ÷ peak FLOP/s, {window}.",
            labels=labels,
        )
        idle = GaugeMetricFamily(
            "phasescope_device_compute_idle_ratio",
            f"Compute idleness of the engine's device: 1 − its MFU over all steps, {window} (1 when idle).",
            labels=labels,
        )
        intensity = GaugeMetricFamily(
            "phasescope_device_arithmetic_intensity_flops_per_byte",
            f"FLOPs per byte moved, all steps, {window}; absent when no step ran.",
            labels=labels,
        )
        busy = GaugeMetricFamily(
            "phasescope_engine_busy_ratio",
            f"Share of the window the engine spent executing steps, {window}.",
            labels=labels,
        )
        for engine, figures in devices.items():
            values = [self._model, str(engine)]
            bandwidth.add_metric(values, figures.memory_bandwidth_utilization)
            compute.add_metric(values, figures.compute_utilization)
            idle.add_metric(values, figures.compute_idle)
            if figures.arithmetic_intensity is not None:
                intensity.add_metric(values, figures.arithmetic_intensity)
            busy.add_metric(values, figures.busy_ratio)
        yield from (bandwidth, compute, idle, intensity, busy)

    def _peak_families(self) -> Iterator[Metric]:
        source = self._peaks.source
        bandwidth = GaugeMetricFamily(
            "phasescope_hardware_peak_memory_bandwidth_bytes_per_second",
            "Peak memory bandwidth each engine is judged against (a CPU's is shared between its engines).",
            labels=["model", "source"],
        )
        bandwidth.add_metric([self._model, source], self._steps.peak_memory_bandwidth_bytes_per_second)
        flops = GaugeMetricFamily(
            "phasescope_hardware_peak_flops_per_second",
            "Peak dense FLOP/s in the served dtype each engine is judged against.",
            labels=["model", "source", "dtype"],
        )
        flops.add_metric([self._model, source, self._dtype], self._steps.peak_flops)
        ridge = GaugeMetricFamily(
            "phasescope_roofline_ridge_point_flops_per_byte",
            "Ridge point = peak FLOP/s ÷ peak bytes/s: the intensity above which a step is compute-bound.",
            labels=["model"],
        )
        ridge.add_metric([self._model], self._steps.peak_flops / self._steps.peak_memory_bandwidth_bytes_per_second)
        info = GaugeMetricFamily(
            "phasescope_hardware_info",
            "The device the engines run on and where its peaks came from (value is always 1).",
            labels=["model", "device", "source", "engines"],
        )
        info.add_metric([self._model, self._peaks.description or self._peaks.device, source, str(self._engines)], 1.0)
        yield from (bandwidth, flops, ridge, info)
        if self._peaks.memory_bytes is not None:
            memory = GaugeMetricFamily(
                "phasescope_hardware_memory_bytes",
                "Memory capacity of each engine's device: the datasheet's (its GB read as GiB), on a CPU the KV "
                "budget the engine was given plus its weights.",
                labels=["model", "source"],
            )
            memory.add_metric([self._model, source], self._peaks.memory_bytes)
            yield memory


def _waiting_for(view: EngineView, reason: str) -> float:
    """The engine's requests waiting now for `reason`: those for an adapter slot apart, the rest under the latest
    sample's reason."""
    if reason == "adapters":
        return float(view.waiting_for_adapters)
    return float(view.waiting - view.waiting_for_adapters) if reason == view.waiting_reason else 0.0
