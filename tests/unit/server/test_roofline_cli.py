import json
import struct
from pathlib import Path

import pytest

from server.cli import main


def test_reference_case_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["roofline", "--params", "70e9", "--dtype", "bf16", "--hardware", "h100-sxm", "--batch-sizes", "1"]) == 0
    )
    out = capsys.readouterr().out
    assert "23.93" in out  # tokens/s per sequence
    assert "3.350" in out  # TFLOP/s
    assert "0.34%" in out  # compute utilisation
    assert "99.66%" in out  # idle
    assert "compute-bound at batch 296" in out


def test_json_carries_the_same_figures_as_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["roofline", "--params", "70e9", "--hardware", "h100-sxm", "--batch-sizes", "1,8", "--json"]) == 0
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
    assert f"no model config at {tmp_path / 'nowhere'}" in line


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
