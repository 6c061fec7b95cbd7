"""vLLM's own Prometheus logger in the front end, its updates waiting in the telemetry pipeline
(`vllm_prometheus_logger`): the reference `vllm:` series phasescope's are compared with.

phasescope's own step telemetry does not come through a front-end stat logger: each engine core reports its
steps itself (phasescope.engine.vllm.core_telemetry).
"""

from __future__ import annotations

import copy

from prometheus_client import Histogram
from vllm.v1.metrics.loggers import PrometheusStatLogger
from vllm.v1.metrics.stats import IterationStats, MultiModalCacheStats, SchedulerStats

from phasescope.telemetry.histograms import observe_all
from phasescope.telemetry.pipeline import TelemetryPipeline


def vllm_prometheus_logger(pipeline: TelemetryPipeline) -> type[PrometheusStatLogger]:
    """vLLM's own Prometheus logger (its `vllm:` series, exactly as it keeps them), its stats updates waiting in
    `pipeline` with phasescope's telemetry. vLLM takes a Prometheus logger class in `AsyncLLM(stat_loggers=[...])`
    in place of its default one and makes it itself, hence a class made here around the pipeline."""

    class PipelinedPrometheusStatLogger(PrometheusStatLogger):
        def record(
            self,
            scheduler_stats: SchedulerStats | None,
            iteration_stats: IterationStats | None,
            mm_cache_stats: MultiModalCacheStats | None = None,
            engine_idx: int = 0,
        ) -> None:
            pipeline.hold(self._record_now, scheduler_stats, iteration_stats, mm_cache_stats, engine_idx)

        def _record_now(
            self,
            scheduler_stats: SchedulerStats | None,
            iteration_stats: IterationStats | None,
            mm_cache_stats: MultiModalCacheStats | None,
            engine_idx: int,
        ) -> None:
            if iteration_stats is None or not iteration_stats.inter_token_latencies_iter:
                super().record(scheduler_stats, iteration_stats, mm_cache_stats=mm_cache_stats, engine_idx=engine_idx)
                return
            # vLLM observes each inter-token gap on its own (one per running request, every step); here the
            # step's are observed together, in one pass, to the same counts and sum (docs/benchmarks.md, "What
            # the telemetry costs"). A copy without them: vLLM's object is read by the step telemetry too.
            without = copy.copy(iteration_stats)
            without.inter_token_latencies_iter = []
            super().record(scheduler_stats, without, mm_cache_stats=mm_cache_stats, engine_idx=engine_idx)
            histogram = self.histogram_inter_token_latency[engine_idx]
            assert isinstance(histogram, Histogram)  # vLLM types its per-engine children as any metric
            observe_all(histogram, iteration_stats.inter_token_latencies_iter)

        def record_sleep_state(self, sleep: int = 0, level: int = 0) -> None:
            pipeline.hand_on()
            super().record_sleep_state(sleep, level)

    return PipelinedPrometheusStatLogger
