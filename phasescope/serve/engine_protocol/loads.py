"""GetLoads: the routing core the gateway scores workers by, from the engine's own figures.

Per engine (a data-parallel rank), from the step aggregator's view over the metrics window:
- running / waiting: the scheduler's latest counts; `num_total_reqs` their sum;
- `token_usage`: the share of KV-cache blocks in use; `num_used_tokens` = that × the cache's
  capacity in tokens (`max_total_num_tokens`: the engine's blocks × block size);
- `gen_throughput`: decode tokens per second measured over the window;
- `utilization`: the device's bandwidth saturation over the window (bytes moved per second ÷
  peak bytes per second), the figure that binds decode;
- `max_running_requests`: the engine's running batch;
- `num_waiting_uncached_tokens`: prompt tokens of the requests handed to the engine that have no
  first token yet (queued or prefilling), less what the prefix cache serves of those it has
  reported; the engine says which rank holds a request only with its first output, so with several
  ranks the tokens are shared evenly between them (an estimate, as vLLM's servicer makes one).
vLLM's own servicer leaves throughput and utilization at 0 at idle; these are measured.

`engine_load` makes the same figures the `EngineLoad` record every `SubscribeKvEvents` batch carries (as vLLM's
worker stamps its batches), with the `speculative` section (mean acceptance length and acceptance rate over the
window) when the engine verified drafts in it.
"""

from __future__ import annotations

from collections.abc import Iterable

from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_servicer.load_record import engine_load_from

from phasescope.engine.base import ModelDescription
from phasescope.serve.watch import InFlight
from phasescope.telemetry.step.aggregator import EngineView


def waiting_uncached_tokens(in_flight: Iterable[InFlight]) -> int:
    """Prompt tokens still to prefill: requests handed to the engine without a first token yet."""
    total = 0
    for request in in_flight:
        handed = request.front.handed_to_engine > 0.0
        answered = request.stamps is not None and request.stamps.first_token_ts > 0.0
        if handed and not answered:
            total += max(0, request.prompt_tokens - request.cached_prompt_tokens)
    return total


def scheduler_loads(
    description: ModelDescription, views: list[EngineView], in_flight: Iterable[InFlight]
) -> list[pb.SchedulerLoad]:
    """One `SchedulerLoad` per engine; engine 0's is there (zeros) before the engine's first step."""
    by_engine = {view.engine: view for view in views}
    ranks = max(1, description.data_parallel_size)
    capacity = description.kv_cache_capacity_tokens
    waiting_tokens = waiting_uncached_tokens(in_flight)
    loads = []
    for rank in range(ranks):
        view = by_engine.get(rank)
        load = pb.SchedulerLoad(
            dp_rank=rank,
            max_total_num_tokens=capacity,
            max_running_requests=description.max_num_seqs,
            # Shared evenly; the first ranks take the remainder.
            num_waiting_uncached_tokens=waiting_tokens // ranks + (1 if rank < waiting_tokens % ranks else 0),
        )
        if view is not None:
            decode = view.phases.get("decode")
            load.num_running_reqs = view.running
            load.num_waiting_reqs = view.waiting
            load.num_total_reqs = view.running + view.waiting
            load.token_usage = view.kv_cache_usage
            load.num_used_tokens = round(view.kv_cache_usage * capacity)
            load.gen_throughput = decode.figures.tokens_per_second if decode is not None else 0.0
            load.utilization = view.device.memory_bandwidth_utilization
        loads.append(load)
    return loads


def engine_load(
    description: ModelDescription, views: list[EngineView], in_flight: Iterable[InFlight], rank: int | None
) -> common_pb2.EngineLoad | None:
    """The load record of `rank` (None: rank 0) from its `scheduler_loads` figures, field for field as GetLoads
    answers; None for a rank the engine does not have."""
    rank = 0 if rank is None else rank
    loads = scheduler_loads(description, views, in_flight)
    if not 0 <= rank < len(loads):
        return None
    record = engine_load_from(loads[rank], queued_token_work=True)
    speculation = next((view.speculation for view in views if view.engine == rank), None)
    if speculation is not None:
        record.speculative.accept_length = speculation.mean_acceptance_length
        record.speculative.accept_rate = speculation.acceptance_rate
    return record
