import pytest

from phasescope.telemetry.hardware.peaks import HardwarePeaks, lookup_device
from phasescope.telemetry.model.cost import model_cost_from_config, model_cost_from_numbers
from phasescope.telemetry.model.roofline import compute_bound_batch_size, decode_step, roofline


def datasheet(name: str) -> HardwarePeaks:
    peaks = lookup_device(name)
    assert peaks is not None, name
    return peaks


H100 = datasheet("h100-sxm")


def test_reference_case_70b_bf16_on_h100_sxm() -> None:
    # The reference case (docs/roofline.md): 3.35e12 / 140e9 ≈ 24 tokens/s; 2 × 70e9 FLOPs per token → ≈ 3.35 TFLOP/s
    # (3.36, the figure usually quoted, rounds 24 tok/s first); 0.34 % of 989 TFLOP/s; idle 99.7 %.
    row = decode_step(model_cost_from_numbers(70_000_000_000, "bf16"), H100, "bf16", batch_size=1, context_length=0)
    assert row.decode_tokens_per_second_total == pytest.approx(23.9, rel=5e-3)
    assert row.achieved_flops_per_second == pytest.approx(3.35e12, rel=5e-3)
    assert row.compute_utilization == pytest.approx(0.00339, rel=5e-3)
    assert row.compute_idle == pytest.approx(0.997, abs=5e-4)
    assert row.memory_bandwidth_utilization == pytest.approx(1.0)
    assert row.bound == "memory"


def test_ridge_point_of_h100() -> None:
    # 989e12 FLOP/s ÷ 3.35e12 bytes/s ≈ 295 FLOP/byte.
    assert H100.ridge_point_flops_per_byte("bf16") == pytest.approx(295.2, rel=1e-3)


def test_batching_multiplies_flops_until_the_ridge() -> None:
    # 70B at TP 2 (the smallest deployment whose weights fit): 35 GB and 70 GFLOP per token on each device.
    cost = model_cost_from_numbers(70_000_000_000, "bf16").sharded(2, 1)
    report = roofline(cost, H100, "bf16", batch_sizes=(1, 64, 1024))
    one, sixty_four, huge = report.rows
    # Same weight read shared by 64 sequences: 64× the FLOP/s at the same step time.
    assert sixty_four.achieved_flops_per_second == pytest.approx(64 * one.achieved_flops_per_second)
    assert sixty_four.decode_tokens_per_second_per_sequence == pytest.approx(one.decode_tokens_per_second_per_sequence)
    assert huge.bound == "compute"
    assert huge.compute_utilization == pytest.approx(1.0)
    assert report.compute_bound_batch_size == 296


def test_kv_cache_traffic_pushes_the_compute_bound_batch_up() -> None:
    config = {"hidden_size": 8192, "num_attention_heads": 64, "num_key_value_heads": 8, "num_hidden_layers": 80}
    cost = model_cost_from_config(config, 70_000_000_000, "bf16")
    short = compute_bound_batch_size(cost, H100, "bf16", context_length=0)
    long = compute_bound_batch_size(cost, H100, "bf16", context_length=4096)
    assert short == 296
    # At 4k context the KV cache read per sequence (4096 × 320 KiB = 1.34 GB) costs more
    # time than its FLOPs: adding sequences never catches up with the bytes.
    assert long is None


def test_prefill_is_compute_bound_and_decode_memory_bound() -> None:
    report = roofline(
        model_cost_from_numbers(8_000_000_000, "bf16"), H100, "bf16", batch_sizes=(1,), prefill_tokens=2048
    )
    assert report.prefill_bound == "compute"
    assert report.rows[0].bound == "memory"
    # 2 × 8e9 × 2048 FLOPs at 989 TFLOP/s.
    assert report.prefill_seconds == pytest.approx(2 * 8e9 * 2048 / 989e12)


def test_json_has_the_documented_fields() -> None:
    data = roofline(
        model_cost_from_numbers(70_000_000_000, "bf16").sharded(2, 1), H100, "bf16", batch_sizes=(1, 2)
    ).to_json()
    for key in (
        "device_memory_bytes",
        "weights_fit",
        "min_tensor_parallel_size",
        "kv_capacity_tokens",
        "max_sequences_at_context",
        "binding_wall",
        "weight_bytes",
        "kv_bytes_per_token",
        "flops_per_token",
        "peak_memory_bandwidth_bytes_per_second",
        "peak_flops",
        "ridge_point_flops_per_byte",
        "compute_bound_batch_size",
        "rows",
    ):
        assert key in data
    for key in (
        "batch_size",
        "decode_tokens_per_second_per_sequence",
        "decode_tokens_per_second_total",
        "achieved_flops_per_second",
        "memory_bandwidth_utilization",
        "compute_utilization",
        "compute_idle",
    ):
        assert key in data["rows"][0]
