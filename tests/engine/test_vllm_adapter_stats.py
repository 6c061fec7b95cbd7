"""The stat logger at vLLM's boundary: vLLM's own stats objects in, step reports out, nothing raised back."""

from types import SimpleNamespace

from prometheus_client import REGISTRY, CollectorRegistry
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.metrics.perf import PerfStats
from vllm.v1.metrics.stats import IterationStats, SchedulerIterationDetails, SchedulerStats

from phasescope.bench.tiny_model import ensure_tiny_model
from phasescope.engine.vllm.stats import PhasescopeStatLogger, stat_logger_factory, vllm_prometheus_logger
from phasescope.telemetry.errors import TelemetryErrors
from phasescope.telemetry.pipeline import TelemetryPipeline
from phasescope.telemetry.step.records import StepForwarder, StepRecord, StepReport


def forwarded() -> tuple[StepForwarder, list[StepReport]]:
    reports: list[StepReport] = []
    forward = StepForwarder()
    forward.sink = reports.append
    return forward, reports


def steps_of(reports: list[StepReport]) -> list[StepRecord]:
    return [report.step for report in reports if report.step is not None]


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
    forward, reports = forwarded()
    logger(forward).record(scheduler_stats(1, 300, 4, 4), None)
    (step,) = steps_of(reports)
    assert (step.prefill_tokens, step.decode_tokens, step.kind) == (300, 4, "mixed")
    assert step.elapsed_seconds == 0.04
    assert step.written_bytes == 1e6
    # Half of 100 blocks × 16 tokens in use.
    assert step.kv_cache_tokens == 800


def test_with_data_parallel_engines_each_reads_its_own_share_of_the_summed_cache() -> None:
    # vLLM's core client sums num_gpu_blocks over the engine cores it talks to (here 2 × 100 blocks);
    # half of one engine's 100 blocks × 16 tokens in use is 800 tokens, not 1,600.
    forward, reports = forwarded()
    config = engine_config(200)
    make = stat_logger_factory(forward)
    loggers = [make(config, engine) for engine in (0, 1)]  # type: ignore[arg-type]  # a stand-in for VllmConfig
    loggers[1].record(scheduler_stats(0, 0, 4, 4), None, engine_idx=1)
    (step,) = steps_of(reports)
    assert (step.engine, step.kv_cache_tokens) == (1, 800)


def test_a_request_resumed_after_preemption_recomputes_as_prefill_not_decode() -> None:
    # vLLM counts a resumed request as "generation" (it has output tokens) while it recomputes
    # its 120 tokens: only one token per decoding sequence is decode work.
    forward, reports = forwarded()
    logger(forward).record(scheduler_stats(0, 0, 4, 3 + 120), None)
    (step,) = steps_of(reports)
    assert step.decode_tokens == 4
    assert step.prefill_tokens == 119


def test_engine_inter_token_latencies_and_preemptions_are_forwarded() -> None:
    forward, reports = forwarded()
    iteration = IterationStats()  # type: ignore[no-untyped-call]  # vLLM leaves its __init__ unannotated
    iteration.inter_token_latencies_iter = [0.01, 0.5]
    iteration.num_preempted_reqs = 1
    logger(forward).record(None, iteration)
    (report,) = reports
    assert report.iteration is not None
    assert list(report.iteration.inter_token_seconds) == [0.01, 0.5]
    assert report.iteration.preemptions == 1
    assert (report.scheduler, report.step) == (None, None)


def test_nothing_raised_inside_telemetry_reaches_vllm() -> None:
    # vLLM propagates a stat logger's exception to every request in flight.
    registry = CollectorRegistry()
    forward = StepForwarder(on_error=TelemetryErrors("m", registry))

    def broken(report: StepReport) -> None:
        raise RuntimeError("sink broke")

    forward.sink = broken
    stat_logger = logger(forward)
    stat_logger.record(scheduler_stats(0, 0, 2, 2), None)
    # A stats object of an unexpected shape (vLLM calls these interfaces unstable) fails in the logger itself.
    stat_logger.record(SimpleNamespace(num_running_reqs=1), None)  # type: ignore[arg-type]  # deliberately malformed
    assert registry.get_sample_value("phasescope_telemetry_errors_total", {"model": "m", "component": "step"}) == 2


def test_why_waiting_requests_wait_is_read_from_the_step_that_left_them_waiting() -> None:
    forward, reports = forwarded()
    log = logger(forward)

    def waiting(running: int, ctx_tokens: int, deferred: int = 0) -> str:
        stats = scheduler_stats(1, ctx_tokens, running - 1, running - 1)
        stats.num_waiting_reqs, stats.num_skipped_waiting_reqs = 3, deferred
        log.record(stats, None)
        assert reports[-1].scheduler is not None
        return reports[-1].scheduler.reason

    # 2 of 8 slots, 301 of 2,048 tokens: what stopped the admission was the KV cache's blocks.
    assert waiting(running=2, ctx_tokens=300) == "kv_cache"
    assert waiting(running=8, ctx_tokens=300) == "slot"
    assert waiting(running=2, ctx_tokens=2047) == "other"  # the budget spent (2,047 + 1 decode token)
    # The deferred (a grammar compiling) are reported apart, as vLLM counts them.
    waiting(running=2, ctx_tokens=300, deferred=2)
    assert reports[-1].scheduler is not None
    assert reports[-1].scheduler.deferred == 2


def test_a_stats_update_is_handed_on_as_one_report() -> None:
    # One hand-over per engine step: its output batch, scheduler state and step together.
    forward, reports = forwarded()
    iteration = IterationStats()  # type: ignore[no-untyped-call]  # vLLM leaves its __init__ unannotated
    iteration.inter_token_latencies_iter = [0.01]
    logger(forward).record(scheduler_stats(1, 300, 4, 4), iteration)
    ((report),) = reports
    assert report.iteration is not None
    assert list(report.iteration.inter_token_seconds) == [0.01]
    assert report.scheduler is not None
    assert (report.scheduler.running, report.scheduler.waiting, report.scheduler.reason) == (5, 0, "kv_cache")
    assert report.step is not None
    assert report.step.kind == "mixed"


def vllm_logger(pipeline: TelemetryPipeline) -> tuple[object, dict[str, str]]:
    config = EngineArgs(model=str(ensure_tiny_model()), enforce_eager=True, max_model_len=256).create_engine_config()
    labels = {"model_name": str(config.model_config.served_model_name), "engine": "0"}
    return vllm_prometheus_logger(pipeline)(config, [0]), labels


def test_vllm_series_wait_in_the_pipeline_and_are_whole_once_handed_on() -> None:
    pipeline = TelemetryPipeline(batch=1000)
    held, labels = vllm_logger(pipeline)
    before = REGISTRY.get_sample_value("vllm:generation_tokens_total", labels) or 0.0
    for tokens in (4, 4, 3):
        iteration = IterationStats()  # type: ignore[no-untyped-call]  # vLLM leaves its __init__ unannotated
        iteration.num_generation_tokens = tokens
        held.record(scheduler_stats(0, 0, tokens, tokens), iteration)  # type: ignore[attr-defined]
    assert pipeline.held == 3
    assert (REGISTRY.get_sample_value("vllm:generation_tokens_total", labels) or 0.0) == before
    pipeline.hand_on()  # what a scrape's first collector does (phasescope.serve.build registers it)
    assert REGISTRY.get_sample_value("vllm:generation_tokens_total", labels) == before + 11
    assert REGISTRY.get_sample_value("vllm:num_requests_running", labels) == 3


def test_vllm_inter_token_latencies_count_and_sum_as_vllm_observes_them() -> None:
    # vLLM's logger observes each of a step's inter-token latencies on its own; here a step's are observed
    # together, and vLLM's series read the same: every latency in its bucket, the sum added up in the same order.
    pipeline = TelemetryPipeline(batch=1000)
    held, labels = vllm_logger(pipeline)
    name = "vllm:inter_token_latency_seconds"
    count_before = REGISTRY.get_sample_value(f"{name}_count", labels) or 0.0
    sum_before = REGISTRY.get_sample_value(f"{name}_sum", labels) or 0.0
    fast_before = REGISTRY.get_sample_value(f"{name}_bucket", {**labels, "le": "0.01"}) or 0.0
    steps = [[0.004 + 0.0001 * i for i in range(step % 5)] + [0.2] for step in range(35)]
    iterations = []
    for latencies in steps:
        iteration = IterationStats()  # type: ignore[no-untyped-call]  # vLLM leaves its __init__ unannotated
        iteration.inter_token_latencies_iter = list(latencies)
        iterations.append(iteration)
        held.record(scheduler_stats(0, 0, len(latencies), len(latencies)), iteration)  # type: ignore[attr-defined]
    pipeline.hand_on()
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
