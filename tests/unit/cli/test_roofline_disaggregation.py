"""`phasescope roofline --disaggregate`: the pools, the KV transfer and the refusals, on the command line.

The figures are derived in tests/unit/telemetry/model/test_disaggregation.py.
"""

import json
from pathlib import Path

import pytest

from phasescope.cli.main import main
from support.model_configs import LLAMA_3_1_70B

# SMALL_MHA of the model tests as a config: 16 layers of 16 KV heads × 128, 1e9 parameters, no vocabulary
# (so no separate embedding or LM head): 131,072 KV bytes per token.
SMALL_MHA_CONFIG = {"hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 16, "num_hidden_layers": 16}


def llama_70b_tp_4(tmp_path: Path) -> list[str]:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_1_70B))
    argv = ["roofline", "--model", str(tmp_path), "--hardware", "h100-sxm", "--tensor-parallel-size", "4"]
    return [*argv, "--disaggregate", "--prompt-tokens", "4096", "--output-tokens", "512", "--request-rate", "30"]


def small_mha(tmp_path: Path) -> list[str]:
    (tmp_path / "config.json").write_text(json.dumps(SMALL_MHA_CONFIG))
    argv = ["roofline", "--model", str(tmp_path), "--parameters-in-checkpoint", "1e9", "--hardware", "h100-sxm"]
    return [*argv, "--disaggregate", "--prompt-tokens", "1024", "--output-tokens", "256", "--request-rate", "100"]


def test_json_carries_a_disaggregation_object(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*llama_70b_tp_4(tmp_path), "--link", "ib-ndr", "--json"]) == 0
    disagg = json.loads(capsys.readouterr().out)["disaggregation"]
    # 4,096 × 327,680 bytes cross per request, 335,544,320 from each of the 4 GPUs over its own 50 GB/s port.
    assert (disagg["kv_bytes_per_token"], disagg["kv_bytes_per_request"]) == (327_680, 1_342_177_280)
    assert disagg["device_kv_bytes_per_request"] == 335_544_320
    assert (disagg["link"], disagg["link_bandwidth_bytes_per_second"]) == ("ib-ndr", 50e9)
    assert disagg["kv_transfer_seconds"] == pytest.approx(0.0067108864)
    assert (disagg["prefill_bound"], disagg["ttft_bound"]) == ("compute", "prefill")
    assert disagg["prefill_seconds"] == pytest.approx(0.14731, abs=1e-5)
    assert disagg["ttft_floor_seconds"] == pytest.approx(disagg["prefill_seconds"] + 0.0067108864)
    assert (disagg["decode_context_length"], disagg["decode_batch_size"], disagg["decode_batch_limit"]) == (
        4352,
        110,
        "capacity",
    )
    assert disagg["prefill_to_decode_gpu_ratio"] == pytest.approx(1.423, abs=1e-3)
    assert (disagg["gpus_per_instance"], disagg["prefill_gpus"], disagg["decode_gpus"]) == (4, 20, 16)
    assert disagg["request_rate_per_second"] == 30


def test_without_the_flag_the_json_has_no_disaggregation(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_1_70B))
    assert main(["roofline", "--model", str(tmp_path), "--tensor-parallel-size", "4", "--json"]) == 0
    assert "disaggregation" not in json.loads(capsys.readouterr().out)


def test_the_table_says_which_part_binds_ttft(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The small model's 134 MB of KV take 5.37 ms over 200 GbE against a 2.14 ms prefill: the transfer binds.
    assert main([*small_mha(tmp_path), "--link", "roce-200g"]) == 0
    out = capsys.readouterr().out
    assert "prefill: 2.14 ms per prompt (compute-bound): 467.232 requests/s per instance, 467.232 per GPU" in out
    assert "decode: batch 481 at context 1,152 (prompt + output ÷ 2; the KV cache's limit)" in out
    assert "balance: 0.18 prefill GPUs per decode GPU" in out
    assert "at 100 requests/s: prefill 1 instance = 1 GPU" in out
    assert "decode 2 instances = 2 GPUs" in out
    assert "KV per request: 1,024 tokens × 131,072 bytes = 0.134 GB" in out
    assert "transfer over roce-200g (25 GB/s per GPU per direction" in out
    assert "the wire floor: no protocol overhead, no layer pipelining" in out
    assert "TTFT floor = prefill 2.14 ms + transfer 5.37 ms = 7.51 ms: transfer binds" in out
    # Over NVLink 4 the same KV takes 0.30 ms: the prefill binds.
    assert main([*small_mha(tmp_path), "--link", "nvlink4"]) == 0
    assert "TTFT floor = prefill 2.14 ms + transfer 0.30 ms = 2.44 ms: prefill binds" in capsys.readouterr().out


def test_a_link_bandwidth_stands_for_an_unlisted_link(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # 134,217,728 bytes ÷ 12.5e9 B/s (100 Gb/s) = 10.74 ms.
    assert main([*small_mha(tmp_path), "--link-bandwidth", "12.5e9", "--json"]) == 0
    disagg = json.loads(capsys.readouterr().out)["disaggregation"]
    assert (disagg["link"], disagg["link_bandwidth_bytes_per_second"]) == ("--link-bandwidth", 12.5e9)
    assert disagg["kv_transfer_seconds"] == pytest.approx(134_217_728 / 12.5e9)


def test_the_default_link_is_400_gbps_infiniband(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*small_mha(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["disaggregation"]["link"] == "ib-ndr"


def test_weights_that_do_not_fit_give_no_disaggregation(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # 70B on one H100: the existing answer (exit 1, the TP that would fit), with no pools to size.
    argv = [arg if arg != "4" else "1" for arg in llama_70b_tp_4(tmp_path)]
    assert main([*argv, "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert (data["weights_fit"], data["disaggregation"]) == (False, None)


def refusal(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Exit status 2 and exactly one line on stderr, no traceback."""
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert "Traceback" not in captured.err
    return lines[0]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--disaggregate", "--request-rate", "1"], "--disaggregate needs --output-tokens"),
        (["--disaggregate"], "--disaggregate needs --output-tokens and --request-rate"),
        (["--output-tokens", "256"], "--output-tokens needs --disaggregate"),
        (["--link", "nvlink4"], "--link needs --disaggregate"),
        (
            ["--disaggregate", "--output-tokens", "0", "--request-rate", "1"],
            "--output-tokens must be at least 1, got 0",
        ),
        (["--disaggregate", "--output-tokens", "8", "--request-rate", "0"], "--request-rate must be a positive number"),
        (
            [
                "--disaggregate",
                "--output-tokens",
                "8",
                "--request-rate",
                "1",
                "--link",
                "ib-ndr",
                "--link-bandwidth",
                "1e9",
            ],
            "--link and --link-bandwidth are alternatives: give one or neither",
        ),
        (
            ["--disaggregate", "--output-tokens", "8", "--request-rate", "1", "--link-bandwidth", "-1"],
            "--link-bandwidth must be a positive number of bytes/s, got -1.0",
        ),
        (
            ["--disaggregate", "--output-tokens", "8", "--request-rate", "1", "--link", "carrier-pigeon"],
            "unknown --link 'carrier-pigeon'; known: nvlink4, ib-ndr, roce-400g, roce-200g, pcie5-x16, pcie4-x16",
        ),
    ],
)
def test_disaggregation_flags_wrong_or_alone_are_one_line_naming_the_flag(
    flags: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(SMALL_MHA_CONFIG))
    argv = ["roofline", "--model", str(tmp_path), "--parameters-in-checkpoint", "1e9", *flags]
    assert message in refusal(argv, capsys)


def test_disaggregation_of_a_bare_parameter_count_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["roofline", "--params", "8e9", "--disaggregate", "--output-tokens", "8", "--request-rate", "1"]
    assert "--disaggregate needs --model: a bare --params has no KV bytes per token" in refusal(argv, capsys)


def test_a_prompt_no_kv_cache_holds_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [arg if arg != "1024" else "10000000" for arg in small_mha(tmp_path)]
    line = refusal(argv, capsys)
    assert "--disaggregate: the KV cache holds no sequence of 10,000,128 tokens" in line
