import json
import struct
from pathlib import Path

import pytest

from phasescope.cli.main import main
from support.model_configs import LLAMA_3_1_70B, MIXTRAL_8X7B


def test_reference_case_table(capsys: pytest.CaptureFixture[str]) -> None:
    # 70B in bf16 fits two H100s, not one: each streams its 70 GB half at 3.35 TB/s, 47.86 steps a second.
    argv = ["roofline", "--params", "70e9", "--dtype", "bf16", "--hardware", "h100-sxm", "--batch-sizes", "1"]
    assert main([*argv, "--tensor-parallel-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "47.86" in out  # tokens/s per sequence
    assert "3.350" in out  # TFLOP/s
    assert "0.34%" in out  # compute utilisation
    assert "99.66%" in out  # idle
    assert "compute-bound at batch 296" in out


def test_a_model_that_does_not_fit_says_so_on_one_line_and_names_the_tp_that_would(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["roofline", "--params", "70e9", "--dtype", "bf16", "--hardware", "h100-sxm"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert "the weights do not fit: 140.0 GB per device" in line
    assert "--tensor-parallel-size 2" in line
    # The same answer as JSON: no impossible rows, the fields that say why.
    assert main(["roofline", "--params", "70e9", "--hardware", "h100-sxm", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert (data["weights_fit"], data["min_tensor_parallel_size"], data["rows"]) == (False, 2, [])
    assert data["device_memory_bytes"] == 80 * 2**30
    # Guards a bug: this said "compute"; with no batch able to run, capacity binds.
    assert data["binding_wall"] == "capacity"


def test_the_kv_capacity_marks_the_batches_that_do_not_fit_and_names_the_binding_wall(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_1_70B))
    argv = ["roofline", "--model", str(tmp_path), "--hardware", "h100-sxm", "--tensor-parallel-size", "4"]
    assert main([*argv, "--context", "4096", "--batch-sizes", "64,128"]) == 0
    out = capsys.readouterr().out
    assert "479,505 tokens of KV cache = 117 sequences of 4,096 tokens" in out
    assert "no KV room" in out  # batch 128
    assert "capacity binds first" in out
    assert main([*argv, "--context", "4096", "--json", "--gpu-memory-utilization", "0.95"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["binding_wall"] == "capacity"
    assert data["gpu_memory_utilization"] == 0.95
    # 0.05 more of 80 GiB is 4,294,967,296 bytes more KV (tests/unit/telemetry/model/test_capacity.py has the rest).
    assert data["kv_capacity_tokens"] == (39_281_094_656 + 4_294_967_296) // 81_920 == 531_934


def test_json_carries_the_same_figures_as_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["roofline", "--params", "70e9", "--hardware", "h100-sxm", "--batch-sizes", "1,8", "--json"]
    assert main([*argv, "--tensor-parallel-size", "2"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["compute_bound_batch_size"] == 296
    # Batch 8 shares each weight read between 8 sequences: 8 × the single-sequence FLOP/s.
    batch_1, batch_8 = data["rows"]
    assert batch_8["achieved_flops_per_second"] == pytest.approx(8 * batch_1["achieved_flops_per_second"], rel=1e-3)
    assert [row["batch_size"] for row in data["rows"]] == [1, 8]
    assert data["rows"][0]["compute_idle"] == pytest.approx(0.9966, abs=1e-4)


def test_plot_is_a_png_of_the_expected_size(tmp_path: Path) -> None:
    path = tmp_path / "roofline.png"
    assert main(["roofline", "--params", "7e9", "--hardware", "l4", "--plot", str(path)]) == 0
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (800, 550)


def test_model_folder_gives_kv_bytes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 30}
    (tmp_path / "config.json").write_text(json.dumps(config))
    argv = ["roofline", "--model", str(tmp_path), "--parameters-in-checkpoint", "134515008", "--json"]
    assert main([*argv, "--dtype", "bf16", "--hardware", "a10g"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 2
    assert data["weight_bytes"] == 134515008 * 2


def refusal(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Exit status 2 and exactly one line on stderr, no traceback."""
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert "Traceback" not in captured.err
    return lines[0]


def test_unknown_hardware_is_refused_naming_the_known_ones(capsys: pytest.CaptureFixture[str]) -> None:
    line = refusal(["roofline", "--params", "1e9", "--hardware", "abacus"], capsys)
    assert "unknown --hardware 'abacus'" in line
    assert "h100-sxm" in line


def test_a_missing_model_path_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = refusal(["roofline", "--model", str(tmp_path / "nowhere"), "--parameters-in-checkpoint", "7e9"], capsys)
    assert f"no model at {tmp_path / 'nowhere'}" in line


def test_a_config_without_the_shape_names_what_it_lacks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A bare MoE config of the kind that printed a traceback: no layer count, width or heads.
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MixtralForCausalLM"], "vocab_size": 32000}))
    line = refusal(["roofline", "--model", str(tmp_path), "--parameters-in-checkpoint", "46.7e9"], capsys)
    assert "lacks num_hidden_layers, hidden_size, num_attention_heads" in line


def test_a_config_that_is_not_json_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text("{not json")
    assert "is not JSON" in refusal(["roofline", "--model", str(tmp_path), "--parameters-in-checkpoint", "1e9"], capsys)


def test_an_unknown_dtype_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert "unknown dtype 'fp7'" in refusal(["roofline", "--params", "1e9", "--dtype", "fp7"], capsys)


def test_tensor_parallel_figures_are_per_device(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # No checkpoint: the parameter count (70,553,706,496) is derived from the config.
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_1_70B))
    argv = ["roofline", "--model", str(tmp_path), "--tensor-parallel-size", "4", "--batch-sizes", "1", "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["parameter_count"], data["tensor_parallel_size"]) == (70_553_706_496, 4)
    assert data["weight_bytes"] == 2 * 70_553_706_496 / 4
    assert data["kv_bytes_per_token"] == 2 * 80 * 2 * 128 * 2  # 2 of the 8 KV heads per GPU
    # Each H100 streams its quarter: 35.3 GB ÷ 3.35 TB/s per step.
    assert data["rows"][0]["step_seconds"] == pytest.approx(2 * 70_553_706_496 / 4 / 3.35e12)


def test_kv_cache_dtype_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_1_70B))
    argv = ["roofline", "--model", str(tmp_path), "--kv-cache-dtype", "fp8", "--json", "--tensor-parallel-size", "2"]
    assert main(argv) == 0
    # Per device of TP 2: 4 of the 8 KV heads, 1 byte each.
    assert json.loads(capsys.readouterr().out)["kv_bytes_per_token"] == 2 * 80 * 4 * 128 * 1


def test_live_points_are_judged_against_the_server_s_own_peaks() -> None:
    from phasescope.cli.roofline import live_points, served_peaks
    from phasescope.telemetry.exposition import parse_samples

    # What a CPU server exports (its measured peaks) — not --hardware's H100 default.
    text = "\n".join(
        [
            "# TYPE phasescope_hardware_peak_memory_bandwidth_bytes_per_second gauge",
            'phasescope_hardware_peak_memory_bandwidth_bytes_per_second{model="m",source="measured"} 2e10',
            "# TYPE phasescope_hardware_peak_flops_per_second gauge",
            'phasescope_hardware_peak_flops_per_second{model="m",source="measured",dtype="float32"} 4e11',
            "# TYPE phasescope_hardware_info gauge",
            'phasescope_hardware_info{model="m",device="cpu (Xeon)",source="measured",engines="1"} 1',
            "# TYPE phasescope_compute_utilization_ratio gauge",
            'phasescope_compute_utilization_ratio{model="m",engine="0",phase="decode"} 0.01',
            "# TYPE phasescope_arithmetic_intensity_flops_per_byte gauge",
            'phasescope_arithmetic_intensity_flops_per_byte{model="m",engine="0",phase="decode"} 0.5',
            "",
        ]
    )
    samples = parse_samples(text)
    peaks = served_peaks(samples)
    assert peaks is not None
    assert (peaks.memory_bandwidth_bytes_per_second, peaks.peak_flops("float32")) == (2e10, 4e11)
    assert (peaks.source, peaks.device) == ("measured", "cpu (Xeon)")
    (point,) = live_points(samples)
    assert point["achieved_flops_per_second"] == pytest.approx(0.01 * 4e11)


def test_bad_parallel_sizes_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    line = refusal(["roofline", "--params", "1e9", "--tensor-parallel-size", "0"], capsys)
    assert "--tensor-parallel-size and --pipeline-parallel-size must be at least 1" in line


def test_a_moe_config_without_checkpoint_is_costed_from_its_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The bare Mixtral config that once printed a traceback now gives a table: 46.7B parameters, 12.9B active.
    config = MIXTRAL_8X7B
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["roofline", "--model", str(tmp_path), "--hardware", "h200", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["parameter_count"], data["active_parameter_count"]) == (46_702_792_704, 12_879_925_248)


def test_cost_per_million_tokens_at_each_batch_size(capsys: pytest.CaptureFixture[str]) -> None:
    # The memory is the datasheet's 80 GB part's, doubled: the one-device price of a 70B model that fits.
    argv = ["roofline", "--params", "70e9", "--hardware", "h100-sxm", "--batch-sizes", "1,64", "--json"]
    argv += ["--device-memory", str(160 * 2**30)]
    assert main([*argv, "--cost-per-hour", "2.5"]) == 0
    batch_1, batch_64 = json.loads(capsys.readouterr().out)["rows"]
    # $2.50 an hour buys 3,600 s × 23.93 tok/s at batch 1: $29.02 per million tokens; batch 64 shares it 64 ways.
    assert batch_1["cost_per_million_tokens"] == pytest.approx(2.5 / (3.35e12 / 140e9 * 3600) * 1e6)
    assert batch_64["cost_per_million_tokens"] == pytest.approx(batch_1["cost_per_million_tokens"] / 64)
    # TP 4 pays four GPUs for a step each streams a quarter of: four times the price, four times the tokens.
    assert main([*argv, "--cost-per-hour", "2.5", "--tensor-parallel-size", "4"]) == 0
    tp_batch_1 = json.loads(capsys.readouterr().out)["rows"][0]
    assert tp_batch_1["decode_tokens_per_second_total"] == pytest.approx(4 * batch_1["decode_tokens_per_second_total"])
    assert tp_batch_1["cost_per_million_tokens"] == pytest.approx(batch_1["cost_per_million_tokens"])


def test_a_negative_price_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--cost-per-hour must be 0 or more" in refusal(
        ["roofline", "--params", "1e9", "--cost-per-hour", "-1"], capsys
    )


SPECULATIVE_70B = ["roofline", "--params", "70e9", "--hardware", "h100-sxm", "--tensor-parallel-size", "2"]
SPECULATIVE_70B += ["--speculative-tokens", "4", "--acceptance-rate", "0.7"]


def test_speculation_reports_tokens_per_step_the_best_k_and_where_it_stops_helping(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # tests/unit/telemetry/model/test_speculation.py derives these: E = (1 − 0.7⁵) ÷ 0.3 = 2.7731; the verify
    # step of 5 tokens per sequence stays memory-bound to batch 59, and speculation loses from batch 164.
    assert main([*SPECULATIVE_70B, "--batch-sizes", "1,64,256"]) == 0
    out = capsys.readouterr().out
    assert "2.7731 tokens emitted per verify step" in out
    assert "best k at acceptance 0.7, batch 1: 16" in out
    assert "speculation stops helping at batch 164" in out
    # Batch 1: 2.7731 × 47.86 = 132.71 tok/s per sequence, 2.77 × plain decode, at 5 FLOP/byte.
    batch_1 = next(line for line in out.splitlines() if line.split()[:2] == ["1", "132.71"])
    assert batch_1.split()[3:] == ["2.77", "16.750", "5.0", "memory"]


def test_speculation_in_json_beside_each_decode_row(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SPECULATIVE_70B, "--batch-sizes", "1,256", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["speculative_tokens_per_step"] == pytest.approx(2.7731)
    assert (data["best_speculative_tokens"], data["speculation_stops_helping_batch_size"]) == (16, 164)
    batch_1, batch_256 = data["rows"]
    assert batch_1["speculative_tokens_per_second_per_sequence"] == pytest.approx(
        2.7731 * batch_1["decode_tokens_per_second_per_sequence"]
    )
    assert (batch_1["speculation_helps"], batch_256["speculation_helps"]) == (True, False)


def test_plot_draws_the_speculative_verify_steps_beside_decode(tmp_path: Path) -> None:
    path = tmp_path / "roofline.png"
    assert main([*SPECULATIVE_70B, "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--speculative-tokens", "4"], "--speculative-tokens and --acceptance-rate go together"),
        (["--acceptance-rate", "0.7"], "--speculative-tokens and --acceptance-rate go together"),
        (["--speculative-tokens", "0", "--acceptance-rate", "0.7"], "--speculative-tokens must be at least 1, got 0"),
        (["--speculative-tokens", "4", "--acceptance-rate", "1"], "--acceptance-rate must be in [0, 1), got 1.0"),
        (["--speculative-tokens", "4", "--acceptance-rate", "-0.5"], "--acceptance-rate must be in [0, 1), got -0.5"),
    ],
)
def test_speculation_flags_out_of_range_or_alone_are_one_line_naming_the_flag(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert message in refusal(["roofline", "--params", "1e9", *flags], capsys)


def test_a_draft_cost_adds_k_draft_steps_to_each_round(capsys: pytest.CaptureFixture[str]) -> None:
    # tests/unit/telemetry/model/test_speculation.py derives these: at batch 1 the round is the 20.896 ms
    # decode step + 4 × 0.05 of it: 2.7731 ÷ 1.2 = 2.31 × plain decode (47.857 tok/s), 110.59 tok/s; the
    # best k falls from 16 to 6 and speculation stops helping at batch 152 instead of 164.
    assert main([*SPECULATIVE_70B, "--draft-cost", "0.05", "--batch-sizes", "1,64,256"]) == 0
    out = capsys.readouterr().out
    assert "(draft cost c = 0.05 of a decode step)" in out
    assert "tok/s = tokens per step ÷ (verify time + k × draft step time)" in out
    assert "best k at acceptance 0.7, batch 1: 6 (3.0588 tokens per step" in out
    assert "speculation stops helping at batch 152" in out
    batch_1 = next(line for line in out.splitlines() if line.split()[:2] == ["1", "110.59"])
    # The verify step's own figures are unchanged; the last column: 4 × 0.05 × 20.896 ms of drafting.
    assert batch_1.split()[3:] == ["2.31", "16.750", "5.0", "memory", "4.1791"]


def test_the_free_drafter_is_named_in_the_header(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SPECULATIVE_70B, "--batch-sizes", "1"]) == 0
    assert "(a free drafter: the upper bound)" in capsys.readouterr().out
    # --draft-cost 0 is the free drafter.
    assert main([*SPECULATIVE_70B, "--batch-sizes", "1", "--draft-cost", "0", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["draft_cost_ratio"], data["draft_model"], data["best_speculative_tokens"]) == (0.0, None, 16)
    assert data["rows"][0]["speculative_draft_seconds"] == 0.0


def test_the_model_as_its_own_draft_model_costs_c_1_and_gives_no_speedup(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_1_70B))
    argv = ["roofline", "--model", str(tmp_path), "--tensor-parallel-size", "4", "--context", "1024"]
    argv += ["--speculative-tokens", "4", "--acceptance-rate", "0.7", "--draft-model", str(tmp_path)]
    assert main([*argv, "--batch-sizes", "1,64", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    # Each draft step is the model's own decode step: a round of 1 + 4 decode steps emits 2.7731 tokens.
    assert data["draft_cost_ratio"] == pytest.approx(1.0, rel=1e-12)
    assert data["draft_model"] == str(tmp_path)
    batch_1 = data["rows"][0]
    assert batch_1["speculative_draft_seconds"] == pytest.approx(4 * batch_1["step_seconds"], rel=1e-12)
    assert batch_1["speculative_speedup_ratio"] == pytest.approx(2.7731 / 5, rel=1e-4)
    assert [row["speculation_helps"] for row in data["rows"]] == [False, False]
    assert (data["best_speculative_tokens"], data["speculation_stops_helping_batch_size"]) == (1, 1)
    assert main([*argv, "--batch-sizes", "1"]) == 0
    out = capsys.readouterr().out
    assert f"(a draft model {tmp_path}: its k steps included, c = 1 of a decode step at batch 1)" in out


def test_plot_draws_the_verify_steps_with_a_draft_model(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_1_70B))
    path = tmp_path / "roofline.png"
    argv = ["roofline", "--model", str(tmp_path), "--tensor-parallel-size", "4", "--speculative-tokens", "4"]
    argv += ["--acceptance-rate", "0.7", "--draft-model", str(tmp_path), "--plot", str(path)]
    assert main(argv) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


SPECULATING = ["--speculative-tokens", "4", "--acceptance-rate", "0.7"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            [*SPECULATING, "--draft-cost", "-0.1"],
            "--draft-cost must be 0 or more (a draft step ÷ a decode step), got -0.1",
        ),
        ([*SPECULATING, "--draft-cost", "nan"], "--draft-cost must be 0 or more"),
        (
            [*SPECULATING, "--draft-cost", "0.1", "--draft-model", "nowhere"],
            "--draft-cost and --draft-model are alternatives: give one or neither",
        ),
        (["--draft-cost", "0.1"], "--draft-cost needs --speculative-tokens and --acceptance-rate"),
        (["--draft-model", "nowhere"], "--draft-model needs --speculative-tokens and --acceptance-rate"),
        ([*SPECULATING, "--draft-model", "/nowhere/at/all"], "--draft-model /nowhere/at/all: no model at"),
    ],
)
def test_drafter_flags_wrong_or_alone_are_one_line_naming_the_flag(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert message in refusal(["roofline", "--params", "1e9", *flags], capsys)
