"""What a test engine core says of itself (`EngineFacts`): the tiny model on a CPU."""

from phasescope.telemetry.model.cost import model_cost_from_numbers
from phasescope.telemetry.step.records import EngineFacts


def tiny_engine_facts(engine: int = 0) -> EngineFacts:
    return EngineFacts(
        engine=engine,
        model_name="tiny",
        model_path="/models/tiny",
        dtype="float32",
        device="cpu (test)",
        on_cpu=True,
        cost=model_cost_from_numbers(1_000_000, "float32"),
        data_parallel_size=1,
        kv_cache_capacity_tokens=4096,
        max_num_seqs=8,
    )
