"""vLLM's own Prometheus logger at vLLM's boundary: its series wait in the pipeline and read as vLLM keeps them."""

from prometheus_client import REGISTRY
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.metrics.stats import IterationStats, SchedulerStats

from phasescope.bench.tiny_model import ensure_tiny_model
from phasescope.engine.vllm.stats import vllm_prometheus_logger
from phasescope.telemetry.pipeline import TelemetryPipeline


def scheduler_stats(running: int) -> SchedulerStats:
    return SchedulerStats(num_running_reqs=running, kv_cache_usage=0.5)


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
        held.record(scheduler_stats(tokens), iteration)  # type: ignore[attr-defined]
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
        held.record(scheduler_stats(len(latencies)), iteration)  # type: ignore[attr-defined]
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
