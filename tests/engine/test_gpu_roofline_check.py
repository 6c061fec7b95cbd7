"""The vLLM-free GPU check, run on a CPU with a tiny shape: its rows and its roofline arithmetic."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[2]


def test_the_cpu_smoke_run_writes_a_row_per_step_with_the_roofline_of_the_shapes_it_ran(tmp_path: Path) -> None:
    output = tmp_path / "check.json"
    command = [
        sys.executable, "-m", "loadtests.gpu_roofline_check", "--device", "cpu",
        "--hidden", "256", "--heads", "4", "--kv-heads", "2", "--head-dim", "64",
        "--intermediate", "512", "--vocab", "1000", "--layers", "2",
        "--batch-sizes", "1,4", "--prompt-lengths", "32",
        "--warmup", "1", "--repeats", "3", "--min-seconds", "0",
        "--peak-memory-bandwidth", "1e11", "--peak-flops", "1e12", "--output", str(output),
    ]  # fmt: skip
    subprocess.run(command, cwd=REPOSITORY, check=True, timeout=60, capture_output=True)
    result = json.loads(output.read_text())

    assert result["device"] == "cpu"
    assert result["layers_run"] == 2
    assert result["peaks"]["memory_bandwidth_source"] == result["peaks"]["flops_source"] == "flag"
    assert [(row["phase"], row["tokens"]) for row in result["rows"]] == [("decode", 1), ("decode", 4), ("prefill", 32)]
    for row in result["rows"]:
        assert row["measured_seconds"] > 0
        assert row["steps_timed"] >= 3
        assert row["predicted_seconds"] > 0
        # No GPM on a CPU: measured columns are null, not zero.
        assert row["gpm_dram_bandwidth_utilization"] is None
        assert row["gpm_tensor_active"] is None

    # Batch 4 by hand. Weight elements per layer: QKV 256 × (4 + 2·2)·64 = 131,072; O 256 × 256 = 65,536;
    # gate+up 256 × 2·512 = 262,144; down 512 × 256 = 131,072; so 589,824 × 2 layers, + LM head 256 × 1000.
    weight_elements = 589_824 * 2 + 256_000
    # Activations, 4 rows in and out of each GEMM: per layer 4 × (768 + 512 + 1280 + 768); the LM head 4 × 1256.
    activation_elements = 4 * (768 + 512 + 1280 + 768) * 2 + 4 * 1256
    bytes_per_step = 2 * (weight_elements + activation_elements)  # bf16
    flops_per_step = 2 * 4 * weight_elements
    decode_4 = result["rows"][1]
    assert decode_4["bytes_per_step"] == bytes_per_step == 2_934_592
    assert decode_4["flops_per_step"] == flops_per_step
    # max(2.93 MB ÷ 100 GB/s, 11.5 MFLOP ÷ 1 TFLOP/s): the bytes take longer, so memory-bound.
    assert decode_4["predicted_seconds"] == pytest.approx(bytes_per_step / 1e11)
    assert decode_4["predicted_bound"] == "memory"
    assert decode_4["modelled_memory_bandwidth_utilization"] == pytest.approx(
        bytes_per_step / decode_4["measured_seconds"] / 1e11
    )
    # Prefill runs the LM head on the last token only.
    prefill = result["rows"][2]
    assert prefill["flops_per_step"] == 2 * (32 * 589_824 * 2 + 256_000)


def test_without_peaks_for_the_device_the_check_says_which_flags_to_give(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "loadtests.gpu_roofline_check", "--device", "cpu", "--output", str(tmp_path / "x")]
    finished = subprocess.run(command, cwd=REPOSITORY, timeout=60, capture_output=True, text=True)
    assert finished.returncode == 2
    assert "--peak-memory-bandwidth" in finished.stderr
