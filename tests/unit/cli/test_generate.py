"""`phasescope generate`'s timing line: every stage the contract carries, in the table's order."""

from __future__ import annotations

from phasescope.cli.generate import format_timings
from phasescope.v1 import inference_pb2 as pb


def test_the_timing_line_lists_each_stage_then_the_request_figures() -> None:
    timings = pb.Timings(
        frontend_seconds=0.0063,
        intake_seconds=0.0017,
        queue_seconds=0.0,
        prefill_seconds=0.2788,
        decode_seconds=0.7223,
        time_to_first_token_seconds=0.2869,
        e2e_seconds=1.0091,
        mean_inter_token_seconds=0.1032,
        decode_tokens_per_second=9.7,
    )
    assert format_timings(timings) == (
        "frontend 6.3 ms | intake 1.7 ms | queue 0.0 ms | prefill 278.8 ms | decode 722.3 ms | "
        "TTFT 286.9 ms | e2e 1009.1 ms | TPOT 103.2 ms | decode 9.7 tok/s"
    )
