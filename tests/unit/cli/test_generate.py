"""`phasescope generate`'s timing line: every stage the contract carries, in the table's order."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from phasescope.cli.generate import (
    UsageError,
    add_cli_args,
    format_logprob,
    format_timings,
    print_sample,
    sampling_from_args,
)
from phasescope.v1 import inference_pb2 as pb


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_cli_args(parser.add_subparsers())
    return parser.parse_args(["generate", "hi", *argv])


def test_a_json_schema_file_becomes_the_requests_structured_output(tmp_path: Path) -> None:
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object"}')
    sampling = sampling_from_args(parse("--json-schema", str(schema), "--min-tokens", "3"))
    assert sampling["structured"] == pb.StructuredOutput(json_schema='{"type": "object"}')
    assert sampling["min_tokens"] == 3


def test_a_regex_and_choices_are_sent_as_asked() -> None:
    assert sampling_from_args(parse("--regex", "[0-9]+"))["structured"] == pb.StructuredOutput(regex="[0-9]+")
    choice = sampling_from_args(parse("--choice", "yes", "--choice", "no"))["structured"]
    assert list(choice.choice.choices) == ["yes", "no"]
    assert "structured" not in sampling_from_args(parse())


def test_a_schema_file_that_is_missing_or_not_json_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="cannot read"):
        sampling_from_args(parse("--json-schema", str(tmp_path / "missing.json")))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(UsageError, match=r"bad\.json is not JSON"):
        sampling_from_args(parse("--json-schema", str(bad)))


def test_one_constraint_at_a_time() -> None:
    with pytest.raises(SystemExit):
        parse("--regex", "a", "--choice", "b")


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
    # A decode worker's request, its KV loaded through the connector inside its prefill.
    timings.kv_transfer_seconds, timings.kv_loaded_tokens = 0.041, 768
    assert "| decode 722.3 ms | kv_transfer 41.0 ms | KV loaded 768 saved 0 tokens | TTFT" in format_timings(timings)


def test_logprobs_are_asked_for_and_printed_one_token_a_line() -> None:
    assert sampling_from_args(parse("--logprobs", "2"))["logprobs"] == 2
    assert "logprobs" not in sampling_from_args(parse())
    entry = pb.TokenLogprob(token_id=42, logprob=-0.5, top=[pb.TopLogprob(token_id=42, logprob=-0.5)])
    assert format_logprob(entry) == "     42  -0.5000 | 42 -0.5000"


def test_each_of_n_samples_prints_as_it_ends_with_its_own_finish_and_timings(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert sampling_from_args(parse("--n", "3", "--temperature", "0.8"))["n"] == 3
    timings = pb.Timings(decode_seconds=0.5, time_to_first_token_seconds=0.1)
    chunks = [
        pb.GenerateStreamResponse(index=2, text="Once "),
        pb.GenerateStreamResponse(index=2, text="upon", finish_reason=pb.FINISH_REASON_LENGTH, timings=timings),
    ]
    print_sample(2, chunks, token_ids_only=False)
    out, err = capsys.readouterr()
    assert out == "--- sample 2 ---\nOnce upon\n"
    assert "[sample 2 finished: length]" in err
    assert "TTFT 100.0 ms" in err
