"""phasescope's accounting inside the engine core: vLLM's scheduler outputs and output batches in, one step report
per step out, nothing raised into the engine loop.

The scheduler is the boundary here: a stand-in gives the parts `CoreTelemetry` reads (its configuration, queues and
KV-cache usage); the scheduler outputs carry what vLLM's `compute_iteration_details` reads; the output batches are
vLLM's own `EngineCoreOutputs`.
"""

from types import SimpleNamespace
from typing import Any

from vllm.v1.engine import EngineCoreEvent, EngineCoreEventType, EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.metrics.perf import PerfStats
from vllm.v1.metrics.stats import PrefillStats

from phasescope.engine.vllm.core_telemetry import CoreTelemetry, decode_tokens
from phasescope.telemetry.step.records import StepReport
from phasescope.telemetry.step.transport import StepPublisher


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Publisher(StepPublisher):
    """The engine core's publisher without its thread: what the engine loop hands it stays in its queue."""

    def __init__(self) -> None:
        super().__init__("ipc:///nowhere", engine=1)

    @property
    def reports(self) -> list[StepReport]:
        return list(self._queue)


def scheduler(running: int = 4, waiting: int = 0, deferred: int = 0, usage: float = 0.5, speculative: int = 0) -> Any:
    config = SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_seqs=8, max_num_batched_tokens=2048),
        speculative_config=SimpleNamespace(num_speculative_tokens=speculative) if speculative else None,
        # 100 blocks of 16 tokens.
        cache_config=SimpleNamespace(num_gpu_blocks=100, block_size=16),
    )
    return SimpleNamespace(
        vllm_config=config,
        get_request_counts=lambda: (running, waiting + deferred),
        deferred_waiting=set(range(deferred)),
        kv_cache_manager=SimpleNamespace(usage=usage),
    )


def scheduled(prefill: dict[str, int], decode: dict[str, int]) -> Any:
    """A scheduler output: new requests prefilling `prefill` tokens each, running ones decoding `decode`."""
    tokens = {**prefill, **decode}
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=request) for request in prefill],
        scheduled_cached_reqs=SimpleNamespace(is_context_phase=lambda request: False),
        num_scheduled_tokens=tokens,
        total_num_scheduled_tokens=sum(tokens.values()),
        scheduled_encoder_input_stats=None,
    )


def output(request: str, tokens: int = 1, finished: bool = False, preempted: bool = False) -> EngineCoreOutput:
    events = [EngineCoreEvent.new_event(EngineCoreEventType.PREEMPTED, 1.0)] if preempted else None
    return EngineCoreOutput(
        request_id=request,
        new_token_ids=list(range(tokens)),
        finish_reason=FinishReason.LENGTH if finished else None,
        events=events,
    )


def step(
    telemetry: CoreTelemetry,
    clock: Clock,
    work: Any,
    outputs: list[EngineCoreOutput],
    seconds: float = 0.04,
    perf: PerfStats | None = None,
) -> None:
    """One engine step as vLLM's engine core drives the scheduler: schedule, execute for `seconds`, update."""
    telemetry.scheduled(work)
    clock.now += seconds
    returned_at = telemetry.updating()
    telemetry.stats_made(perf, None)  # as vLLM's update_from_output makes its stats
    telemetry.updated(work, {0: EngineCoreOutputs(outputs=outputs, timestamp=clock.now)}, returned_at)


def made(**kwargs: Any) -> tuple[CoreTelemetry, Publisher, Clock]:
    publisher, clock = Publisher(), Clock()
    return CoreTelemetry(scheduler(**kwargs), publisher, clock), publisher, clock


def test_a_mixed_step_becomes_one_report_with_its_work_time_flops_and_kv_tokens() -> None:
    telemetry, publisher, clock = made(running=5)
    perf = PerfStats(num_flops_per_gpu=10**9, num_read_bytes_per_gpu=5 * 10**8, num_write_bytes_per_gpu=10**6)
    decoding = {f"d{i}": 1 for i in range(4)}
    step(telemetry, clock, scheduled({"p": 300}, decoding), [output(r) for r in ("p", *decoding)], perf=perf)
    (report,) = publisher.reports
    assert report.step is not None
    assert (report.step.engine, report.step.prefill_tokens, report.step.decode_tokens) == (1, 300, 4)
    assert (report.step.prefill_requests, report.step.decode_requests, report.step.kind) == (1, 4, "mixed")
    # From the batch handed to the executor to its output back.
    assert abs(report.step.elapsed_seconds - 0.04) < 1e-12
    assert (report.step.flops, report.step.read_bytes, report.step.written_bytes) == (1e9, 5e8, 1e6)
    # Half of 100 blocks × 16 tokens in use.
    assert report.step.kv_cache_tokens == 800
    assert report.scheduler is not None
    assert (report.scheduler.running, report.scheduler.waiting, report.scheduler.engine) == (5, 0, 1)


def test_a_steps_time_starts_when_the_previous_step_ended_if_they_overlapped() -> None:
    # vLLM's async scheduling hands the next batch to the executor before the previous one's output is back:
    # the engine was busy with it only from that output on.
    telemetry, publisher, clock = made()
    first, second = scheduled({}, {"a": 1}), scheduled({}, {"a": 1})
    telemetry.scheduled(first)
    telemetry.scheduled(second)  # at the same moment
    clock.now += 0.03
    telemetry.updated(first, {0: EngineCoreOutputs(outputs=[output("a")], timestamp=clock.now)}, telemetry.updating())
    clock.now += 0.02
    telemetry.updated(second, {0: EngineCoreOutputs(outputs=[output("a")], timestamp=clock.now)}, telemetry.updating())
    elapsed = [report.step.elapsed_seconds for report in publisher.reports if report.step is not None]
    assert [round(seconds, 9) for seconds in elapsed] == [0.03, 0.02]


def test_a_request_resumed_after_preemption_recomputes_as_prefill_not_decode() -> None:
    # vLLM counts a resumed request as "generation" (it has output tokens) while it recomputes its 120 tokens.
    assert decode_tokens(4, 3 + 120, 1) == 4
    telemetry, publisher, clock = made()
    step(telemetry, clock, scheduled({}, {"a": 1, "b": 1, "c": 1, "resumed": 120}), [])
    (report,) = publisher.reports
    assert report.step is not None
    assert (report.step.decode_tokens, report.step.prefill_tokens) == (4, 119)


def test_under_speculation_a_decoding_sequence_verifies_its_drafts_as_decode() -> None:
    telemetry, publisher, clock = made(speculative=3)
    step(telemetry, clock, scheduled({}, {"a": 4, "b": 4}), [])
    (report,) = publisher.reports
    assert report.step is not None
    assert (report.step.decode_tokens, report.step.prefill_tokens) == (8, 0)


def test_inter_token_gaps_are_taken_on_the_output_batches_own_timestamps() -> None:
    # As vLLM's front end takes them: a request's first tokens have no gap, each later batch's gap is its
    # timestamp less the request's previous one.
    telemetry, publisher, clock = made()
    step(telemetry, clock, scheduled({"a": 30}, {}), [output("a")], seconds=0.1)
    step(telemetry, clock, scheduled({"b": 30}, {"a": 1}), [output("a"), output("b")], seconds=0.05)
    step(telemetry, clock, scheduled({}, {"a": 1, "b": 1}), [output("a", finished=True), output("b")], seconds=0.02)
    assert gaps_of(publisher.reports) == [[], [0.05], [0.02, 0.02]]
    # A finished request is forgotten: the same id again is a new request, with no gap to the old one.
    step(telemetry, clock, scheduled({"a": 30}, {}), [output("a")])
    iteration = publisher.reports[-1].iteration
    assert iteration is not None
    assert list(iteration.inter_token_seconds) == []


def gaps_of(reports: list[StepReport]) -> list[list[float]]:
    """Each output batch's inter-token gaps, one per request (the reports carry each run's gap with its length)."""
    gaps = []
    for report in reports:
        if report.iteration is not None:
            iteration = report.iteration
            runs = zip(iteration.inter_token_seconds, iteration.gap_counts(), strict=True)
            gaps.append([round(gap, 9) for gap, count in runs for _ in range(count)])
    return gaps


def test_a_steps_gaps_go_as_runs_of_requests_whose_previous_tokens_came_together() -> None:
    telemetry, publisher, clock = made()
    step(telemetry, clock, scheduled({"a": 30, "b": 30, "c": 30}, {}), [output(r) for r in "abc"], seconds=0.1)
    step(telemetry, clock, scheduled({}, {"a": 1, "c": 1}), [output("a"), output("c")], seconds=0.02)  # b skipped
    step(telemetry, clock, scheduled({}, dict.fromkeys("abc", 1)), [output(r) for r in "acb"], seconds=0.03)
    iteration = publisher.reports[-1].iteration
    assert iteration is not None
    # a and c got their previous tokens together: one run of two; b's came a step earlier.
    assert [round(gap, 9) for gap in iteration.inter_token_seconds] == [0.03, 0.05]
    assert iteration.inter_token_counts == (2, 1)
    assert gaps_of(publisher.reports) == [[], [0.02, 0.02], [0.03, 0.03, 0.05]]


def test_an_aborted_request_is_recorded_at_once_and_forgotten() -> None:
    telemetry, publisher, clock = made()
    telemetry.added(SimpleNamespace(request_id="a", num_prompt_tokens=30))
    step(telemetry, clock, scheduled({"a": 30}, {}), [output("a")])
    telemetry.aborted(["a"], {})  # the front end aborted it (no step carries it: it is published on its own)
    (record,) = publisher.reports[-1].finished
    assert (record.request_id, record.finish_reason) == ("a", "abort")
    assert (record.prompt_tokens, record.output_tokens) == (30, 1)
    # The same id again is a new request, with no gap to the old one.
    step(telemetry, clock, scheduled({"a": 30}, {}), [output("a")])
    iteration = publisher.reports[-1].iteration
    assert iteration is not None
    assert list(iteration.inter_token_seconds) == []


def test_a_request_aborted_while_queued_keeps_the_stamps_the_engine_had_not_sent_yet() -> None:
    telemetry, publisher, _ = made()
    telemetry.added(SimpleNamespace(request_id="q", num_prompt_tokens=12))
    queued = SimpleNamespace(events=[EngineCoreEvent.new_event(EngineCoreEventType.QUEUED, 7.5)])
    telemetry.aborted("q", {"q": queued})
    (record,) = publisher.reports[-1].finished
    assert (record.queued_ts, record.scheduled_ts, record.first_token_ts) == (7.5, 0.0, 0.0)


def test_a_finished_request_carries_the_engines_stamps_and_counts_as_vllms_front_end_derives_them() -> None:
    telemetry, publisher, clock = made()
    telemetry.added(SimpleNamespace(request_id="a", num_prompt_tokens=30))
    first = EngineCoreOutput(
        request_id="a",
        new_token_ids=[1],
        prefill_stats=PrefillStats(num_prompt_tokens=30, num_computed_tokens=14, num_cached_tokens=16),
        events=[
            EngineCoreEvent.new_event(EngineCoreEventType.QUEUED, 100.0),
            EngineCoreEvent.new_event(EngineCoreEventType.SCHEDULED, 100.01),
        ],
    )
    step(telemetry, clock, scheduled({"a": 14}, {}), [first], seconds=0.1)  # the output batch at 100.1
    rescheduled = EngineCoreOutput(
        request_id="a",
        new_token_ids=[2, 3],
        events=[
            EngineCoreEvent.new_event(EngineCoreEventType.PREEMPTED, 100.12),
            EngineCoreEvent.new_event(EngineCoreEventType.SCHEDULED, 100.13),
        ],
    )
    step(telemetry, clock, scheduled({}, {"a": 2}), [rescheduled], seconds=0.05)  # at 100.15
    step(telemetry, clock, scheduled({}, {"a": 1}), [output("a", finished=True)], seconds=0.05)  # at 100.2
    (record,) = publisher.reports[-1].finished
    assert (record.queued_ts, record.scheduled_ts) == (100.0, 100.01)  # the first SCHEDULED
    assert round(record.first_token_ts, 9) == 100.1
    assert round(record.last_token_ts, 9) == 100.2
    assert (record.prompt_tokens, record.cached_prompt_tokens, record.output_tokens) == (30, 16, 4)
    assert (record.finish_reason, record.preemptions, record.engine, record.request_id) == ("length", 1, 1, "a")
    emitted = [report.iteration.emitted_tokens for report in publisher.reports if report.iteration is not None]
    assert emitted == [1, 2, 1]


def test_preemptions_are_counted_from_the_outputs_events_and_name_the_kv_cache_as_the_wait() -> None:
    telemetry, publisher, clock = made(running=2, waiting=3)
    step(telemetry, clock, scheduled({}, {"a": 1, "b": 1}), [output("a", preempted=True), output("b")])
    report = publisher.reports[-1]
    assert report.iteration is not None
    assert report.scheduler is not None
    assert report.iteration.preemptions == 1
    assert report.scheduler.reason == "kv_cache"


def test_why_waiting_requests_wait_is_read_from_the_step_that_left_them_waiting() -> None:
    def reason(running: int, prefill_tokens: int, deferred: int = 0) -> tuple[str, int, int]:
        telemetry, publisher, clock = made(running=running, waiting=3, deferred=deferred)
        decoding = {f"d{i}": 1 for i in range(running - 1)}
        step(telemetry, clock, scheduled({"p": prefill_tokens}, decoding), [])
        state = publisher.reports[-1].scheduler
        assert state is not None
        return state.reason, state.waiting, state.deferred

    # 2 of 8 slots, 301 of 2,048 tokens: what stopped the admission was the KV cache's blocks.
    assert reason(running=2, prefill_tokens=300) == ("kv_cache", 3, 0)
    assert reason(running=8, prefill_tokens=300) == ("slot", 3, 0)
    assert reason(running=2, prefill_tokens=2047) == ("other", 3, 0)  # the budget spent (2,047 + 1 decode token)
    # Requests held back while their grammar compiles are reported apart, as vLLM counts them.
    assert reason(running=2, prefill_tokens=300, deferred=2) == ("kv_cache", 3, 2)


def test_a_step_that_scheduled_nothing_reports_the_scheduler_only() -> None:
    telemetry, publisher, clock = made(running=0, waiting=1)
    step(telemetry, clock, scheduled({}, {}), [])
    (report,) = publisher.reports
    assert report.step is None
    assert report.scheduler is not None
    assert report.scheduler.waiting == 1


def test_a_step_that_cannot_be_accounted_is_dropped_and_counted_never_raised_into_the_engine() -> None:
    # vLLM's scheduler internals are unstable: one of an unexpected shape costs the step's report only.
    publisher, clock = Publisher(), Clock()
    broken = scheduler()
    broken.get_request_counts = lambda: None  # not a pair
    telemetry = CoreTelemetry(broken, publisher, clock)
    step(telemetry, clock, scheduled({}, {"a": 1}), [output("a")])
    assert publisher.reports == []
    health = publisher.health()
    assert (health.dropped_reports, health.hook_calls) == (1, 1)


def test_the_hooks_time_on_the_engine_loop_is_counted_per_step() -> None:
    telemetry, publisher, clock = made()
    for _ in range(3):
        step(telemetry, clock, scheduled({}, {"a": 1}), [output("a")])
    health = publisher.health()
    assert health.hook_calls == 3
    assert health.hook_seconds == 0.0  # the stand-in clock stood still while the hook ran
