"""The stat logger at vLLM's boundary: vLLM's own stats objects in, step reports out, nothing raised back."""

import asyncio
import random
from types import SimpleNamespace

from prometheus_client import REGISTRY, CollectorRegistry
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.metrics.perf import PerfStats
from vllm.v1.metrics.stats import IterationStats, SchedulerIterationDetails, SchedulerStats

from phasescope.bench.tiny_model import ensure_tiny_model
from phasescope.engine.vllm.stats import (
    HELD_PROMETHEUS_STEPS,
    HeldPrometheusStatLogger,
    PhasescopeStatLogger,
    stat_logger_factory,
)
from phasescope.telemetry.errors import TelemetryErrors
from phasescope.telemetry.hardware.peaks import HardwarePeaks
from phasescope.telemetry.model.cost import model_cost_from_config
from phasescope.telemetry.step.aggregator import StepAggregator
from phasescope.telemetry.step.records import EngineIteration, StepForwarder, StepRecord


def logger(forward: StepForwarder) -> PhasescopeStatLogger:
    # The engine configuration is the boundary here: only the parts the logger reads.
    return PhasescopeStatLogger(engine_config(100), 0, forward)  # type: ignore[arg-type]  # a stand-in for VllmConfig


def engine_config(blocks: int) -> SimpleNamespace:
    """The cache, scheduler and speculation settings the logger reads: 16-token blocks, 8 slots, 2,048 tokens a step."""
    return SimpleNamespace(
        cache_config=SimpleNamespace(num_gpu_blocks=blocks, block_size=16),
        scheduler_config=SimpleNamespace(max_num_seqs=8, max_num_batched_tokens=2048),
        speculative_config=None,
    )


def scheduler_stats(ctx_requests: int, ctx_tokens: int, gen_requests: int, gen_tokens: int) -> SchedulerStats:
    return SchedulerStats(
        num_running_reqs=ctx_requests + gen_requests,
        kv_cache_usage=0.5,
        iteration_details=SchedulerIterationDetails(
            iteration_index=1,
            num_ctx_requests=ctx_requests,
            num_ctx_tokens=ctx_tokens,
            num_generation_requests=gen_requests,
            num_generation_tokens=gen_tokens,
            elapsed_ms=40.0,
        ),
        perf_stats=PerfStats(num_flops_per_gpu=10**9, num_read_bytes_per_gpu=5 * 10**8, num_write_bytes_per_gpu=10**6),
    )


def test_a_step_becomes_a_record_with_written_bytes_and_kv_tokens() -> None:
    steps: list[StepRecord] = []
    forward = StepForwarder()
    forward.sink = steps.append
    logger(forward).record(scheduler_stats(1, 300, 4, 4), None)
    (step,) = steps
    assert (step.prefill_tokens, step.decode_tokens, step.kind) == (300, 4, "mixed")
    assert step.elapsed_seconds == 0.04
    assert step.written_bytes == 1e6
    # Half of 100 blocks × 16 tokens in use.
    assert step.kv_cache_tokens == 800


def test_with_data_parallel_engines_each_reads_its_own_share_of_the_summed_cache() -> None:
    # vLLM's core client sums num_gpu_blocks over the engine cores it talks to (here 2 × 100 blocks);
    # half of one engine's 100 blocks × 16 tokens in use is 800 tokens, not 1,600.
    steps: list[StepRecord] = []
    forward = StepForwarder()
    forward.sink = steps.append
    config = engine_config(200)
    make = stat_logger_factory(forward)
    loggers = [make(config, engine) for engine in (0, 1)]  # type: ignore[arg-type]  # a stand-in for VllmConfig
    loggers[1].record(scheduler_stats(0, 0, 4, 4), None, engine_idx=1)
    (step,) = steps
    assert (step.engine, step.kv_cache_tokens) == (1, 800)


def test_a_request_resumed_after_preemption_recomputes_as_prefill_not_decode() -> None:
    # vLLM counts a resumed request as "generation" (it has output tokens) while it recomputes
    # its 120 tokens: only one token per decoding sequence is decode work.
    steps: list[StepRecord] = []
    forward = StepForwarder()
    forward.sink = steps.append
    logger(forward).record(scheduler_stats(0, 0, 4, 3 + 120), None)
    (step,) = steps
    assert step.decode_tokens == 4
    assert step.prefill_tokens == 119


def test_engine_inter_token_latencies_and_preemptions_are_forwarded() -> None:
    seen: list[EngineIteration] = []
    forward = StepForwarder()
    forward.iteration_sink = seen.append
    iteration = IterationStats()  # type: ignore[no-untyped-call]  # vLLM leaves its __init__ unannotated
    iteration.inter_token_latencies_iter = [0.01, 0.5]
    iteration.num_preempted_reqs = 1
    logger(forward).record(None, iteration)
    assert list(seen[0].inter_token_seconds) == [0.01, 0.5]
    assert seen[0].preemptions == 1


def test_nothing_raised_inside_telemetry_reaches_vllm() -> None:
    # vLLM propagates a stat logger's exception to every request in flight.
    registry = CollectorRegistry()
    forward = StepForwarder(on_error=TelemetryErrors("m", registry))

    def broken(step: StepRecord) -> None:
        raise RuntimeError("sink broke")

    forward.sink = broken
    stat_logger = logger(forward)
    stat_logger.record(scheduler_stats(0, 0, 2, 2), None)
    # A stats object of an unexpected shape (vLLM calls these interfaces unstable) fails in the logger itself.
    stat_logger.record(SimpleNamespace(num_running_reqs=1), None)  # type: ignore[arg-type]  # deliberately malformed
    assert registry.get_sample_value("phasescope_telemetry_errors_total", {"model": "m", "component": "step"}) == 2


def test_why_waiting_requests_wait_is_read_from_the_step_that_left_them_waiting() -> None:
    queued: list[tuple[int, int, int, float, int, str]] = []
    forward = StepForwarder()
    forward.queue_sink = lambda *report: queued.append(report)  # type: ignore[arg-type]  # records the tuple
    log = logger(forward)

    def waiting(running: int, ctx_tokens: int, deferred: int = 0) -> str:
        stats = scheduler_stats(1, ctx_tokens, running - 1, running - 1)
        stats.num_waiting_reqs, stats.num_skipped_waiting_reqs = 3, deferred
        log.record(stats, None)
        return queued[-1][-1]

    # 2 of 8 slots, 301 of 2,048 tokens: what stopped the admission was the KV cache's blocks.
    assert waiting(running=2, ctx_tokens=300) == "kv_cache"
    assert waiting(running=8, ctx_tokens=300) == "slot"
    assert waiting(running=2, ctx_tokens=2047) == "other"  # the budget spent (2,047 + 1 decode token)
    # The deferred (a grammar compiling) are reported apart, as vLLM counts them.
    waiting(running=2, ctx_tokens=300, deferred=2)
    assert queued[-1][4] == 2


def test_a_stats_update_is_handed_on_as_one_report() -> None:
    # One hand-over per engine step: its output batch, scheduler state and step together.
    reports: list[tuple[object, ...]] = []
    forward = StepForwarder()
    forward.report_sink = lambda *report: reports.append(report)
    iteration = IterationStats()  # type: ignore[no-untyped-call]  # vLLM leaves its __init__ unannotated
    iteration.inter_token_latencies_iter = [0.01]
    logger(forward).record(scheduler_stats(1, 300, 4, 4), iteration)
    ((batch, queue, step),) = reports
    assert isinstance(batch, EngineIteration)
    assert list(batch.inter_token_seconds) == [0.01]
    assert queue == (0, 5, 0, 0.5, 0, "kv_cache")
    assert isinstance(step, StepRecord)
    assert step.kind == "mixed"


def test_vllm_series_are_whole_at_every_scrape_while_their_reports_are_held() -> None:
    # vLLM's own Prometheus logger, its reports held: fewer updates than it holds at a time still all count.
    config = EngineArgs(model=str(ensure_tiny_model()), enforce_eager=True, max_model_len=256).create_engine_config()
    held = HeldPrometheusStatLogger(config, [0])
    labels = {"model_name": str(config.model_config.served_model_name), "engine": "0"}
    before = REGISTRY.get_sample_value("vllm:generation_tokens_total", labels) or 0.0
    for tokens in (4, 4, 3):
        iteration = IterationStats()  # type: ignore[no-untyped-call]  # vLLM leaves its __init__ unannotated
        iteration.num_generation_tokens = tokens
        held.record(scheduler_stats(0, 0, tokens, tokens), iteration)
    assert REGISTRY.get_sample_value("vllm:generation_tokens_total", labels) == before + 11
    assert REGISTRY.get_sample_value("vllm:num_requests_running", labels) == 3
    assert held.held == 0
    # At most a batch is held, without any scrape.
    for step in range(1, 2 * HELD_PROMETHEUS_STEPS + 1):
        held.record(scheduler_stats(0, 0, 1, 1), None)
        assert held.held == step % HELD_PROMETHEUS_STEPS


def test_on_the_event_loop_vllm_series_are_handed_on_after_what_the_loop_has_ready() -> None:
    # The output handler fills the batch right after it woke the step's requests: their chunks go first.
    config = EngineArgs(model=str(ensure_tiny_model()), enforce_eager=True, max_model_len=256).create_engine_config()
    held = HeldPrometheusStatLogger(config, [0])
    seen: list[int] = []

    async def scenario() -> None:
        asyncio.get_running_loop().call_soon(lambda: seen.append(held.held))
        for _ in range(HELD_PROMETHEUS_STEPS):
            held.record(scheduler_stats(0, 0, 1, 1), None)
        seen.append(held.held)
        await asyncio.sleep(0)
        seen.append(held.held)

    asyncio.run(scenario())
    assert seen == [HELD_PROMETHEUS_STEPS, HELD_PROMETHEUS_STEPS, 0]


def test_vllm_inter_token_latencies_count_and_sum_as_vllm_observes_them() -> None:
    # vLLM's logger observes each of a step's inter-token latencies; held, they are observed a batch at a time,
    # and vLLM's series read the same: every latency in its bucket, the sum added up in the same order.
    config = EngineArgs(model=str(ensure_tiny_model()), enforce_eager=True, max_model_len=256).create_engine_config()
    held = HeldPrometheusStatLogger(config, [0])
    labels = {"model_name": str(config.model_config.served_model_name), "engine": "0"}
    name = "vllm:inter_token_latency_seconds"
    count_before = REGISTRY.get_sample_value(f"{name}_count", labels) or 0.0
    sum_before = REGISTRY.get_sample_value(f"{name}_sum", labels) or 0.0
    fast_before = REGISTRY.get_sample_value(f"{name}_bucket", {**labels, "le": "0.01"}) or 0.0
    steps = [[0.004 + 0.0001 * i for i in range(step % 5)] + [0.2] for step in range(HELD_PROMETHEUS_STEPS + 3)]
    iterations = []
    for latencies in steps:
        iteration = IterationStats()  # type: ignore[no-untyped-call]  # vLLM leaves its __init__ unannotated
        iteration.inter_token_latencies_iter = list(latencies)
        iterations.append(iteration)
        held.record(scheduler_stats(0, 0, len(latencies), len(latencies)), iteration)
    held.hand_on()
    expected_sum = sum_before
    for latencies in steps:
        for latency in latencies:
            expected_sum += latency
    assert REGISTRY.get_sample_value(f"{name}_count", labels) == count_before + sum(map(len, steps))
    assert REGISTRY.get_sample_value(f"{name}_sum", labels) == expected_sum
    fast = sum(latency <= 0.01 for latencies in steps for latency in latencies)
    assert REGISTRY.get_sample_value(f"{name}_bucket", {**labels, "le": "0.01"}) == fast_before + fast
    # The stats objects are vLLM's, shared with the other loggers: left as they came.
    assert [iteration.inter_token_latencies_iter for iteration in iterations] == steps


def test_a_report_built_when_its_batch_is_handed_on_reads_as_one_built_at_once() -> None:
    # Served, the logger takes only the interference ledger's entry as a step comes (the requests the step woke
    # read it next) and builds the report from vLLM's objects with the held batch: the ledger after every step,
    # and the window once handed on, read as if each report had been built at once.
    cost = model_cost_from_config(
        {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2},
        parameter_count=1_000_000,
        dtype="float32",
    )
    peaks = HardwarePeaks("toy", 100e9, {"fp32": 1e12}, "measured", "toy device")
    clock = [1000.0]
    at_once = StepAggregator(cost, "float32", peaks, clock=lambda: clock[0], batch_reports=1)
    held = StepAggregator(cost, "float32", peaks, clock=lambda: clock[0], batch_reports=64)
    direct, deferred = StepForwarder(), StepForwarder()
    direct.report_sink = at_once.record_report
    deferred.report_sink, deferred.held_sink = held.record_report, held.record_held
    loggers = logger(direct), logger(deferred)
    rng = random.Random(5)
    # A mixed step before any decode-only one (the roofline split stands in), a resumed request recomputing
    # (generation tokens beyond one per request), prefill alone, a dummy step, then a seeded mix.
    updates = [scheduler_stats(1, 300, 4, 4), scheduler_stats(0, 0, 3, 40), scheduler_stats(2, 500, 0, 0)]
    dummy = scheduler_stats(0, 0, 2, 2)
    assert dummy.iteration_details is not None
    dummy.iteration_details.is_dummy = True
    updates.append(dummy)
    for _ in range(150):
        decoding = rng.randint(1, 8)
        update = scheduler_stats(int(rng.random() < 0.3), rng.choice([0, 0, 120]), decoding, decoding)
        assert update.iteration_details is not None
        update.iteration_details.elapsed_ms = rng.uniform(5.0, 60.0)
        updates.append(update)
    for update in updates:
        clock[0] += 0.02
        iteration = IterationStats()  # type: ignore[no-untyped-call]  # vLLM leaves its __init__ unannotated
        iteration.inter_token_latencies_iter = [0.02] * update.num_running_reqs
        for each in loggers:
            each.record(update, iteration)
        assert held.read_interference(0) == at_once.read_interference(0)
    assert held.read_interference(0).stalled_seconds > 0
    held.flush_reports()
    assert held.views() == at_once.views()
