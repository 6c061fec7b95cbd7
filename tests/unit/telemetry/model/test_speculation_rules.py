"""The speculation rules the calculator and the step attribution share (phasescope.telemetry.model.speculation):
a verify step's work, a draft step's, the tokens a verify step emits and the drafter's share of its time.

Every figure is derived by hand in the comments, on a toy model: 1,000,000 parameters in float32 (4,000,000
bytes of weights, 2,000,000 FLOPs a position), 2 layers of 2 KV heads × 16 dims (2 × 2 × 2 × 16 × 4 = 512 KV
bytes a token) and an attention width of 64 (4 × 2 layers × 64 = 512 FLOPs a (query, context) pair).
"""

from __future__ import annotations

import pytest

from phasescope.telemetry.hardware.peaks import HardwarePeaks
from phasescope.telemetry.model.cost import model_cost_from_config
from phasescope.telemetry.model.speculation import (
    Drafter,
    decode_work,
    draft_step_seconds,
    draft_work,
    drafter_seconds,
    emitted_tokens,
    useful_flops,
    verify_attention_pairs,
    verify_step,
    verify_work,
)

TOY = model_cost_from_config(
    {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2},
    parameter_count=1_000_000,
    dtype="float32",
)
# 100 GB/s and 1 TFLOP/s: ridge point 10 FLOP/byte.
PEAKS = HardwarePeaks("toy", 100e9, {"fp32": 1e12}, "measured", "toy device")


def test_the_toy_model_is_as_the_comments_say() -> None:
    assert (TOY.device_weight_bytes, TOY.device_kv_cache_bytes_per_token) == (4_000_000, 512)
    assert (TOY.decode_flops(1), TOY.decode_flops(0, 1)) == (2_000_000, 512)


def test_a_verify_step_reads_the_weights_once_for_all_its_positions() -> None:
    # 2 sequences at context 1,000 with k = 3 drafts each: 8 positions. Position i = 0..3 attends to the 1,000
    # tokens and the i drafts before it: 4 × 1,000 + (0 + 1 + 2 + 3) = 4,006 pairs a sequence, 8,012 in all.
    pairs = verify_attention_pairs(2, 1000, 3)
    assert pairs == 8012
    work = verify_work(TOY, 8, 2 * 1000, pairs)
    # FLOPs: 8 × 2,000,000 + 8,012 × 512 = 16,000,000 + 4,102,144.
    assert work.flops == 20_102_144
    # Read: the weights once + 2,000 tokens of KV × 512; written: 8 new positions' KV × 512.
    assert (work.read_bytes, work.written_bytes) == (4_000_000 + 1_024_000, 4096)
    assert work.moved_bytes == 5_028_096


def test_a_plain_decode_step_is_one_position_a_sequence_and_the_calculator_counts_its_reads() -> None:
    # 2 sequences at context 1,000: 2 × 2,000,000 + 2,000 × 512 FLOPs; the weights + 2,000 × 512 bytes read.
    plain = decode_work(TOY, 2, 2000)
    assert (plain.flops, plain.read_bytes, plain.written_bytes) == (5_024_000, 5_024_000, 1024)
    # The calculator's verify step with no drafts is the same pass (its bytes: those read).
    step = verify_step(TOY, PEAKS, "fp32", 2, 1000, 0)
    assert (step.flops_per_step, step.bytes_per_step) == (plain.flops, plain.read_bytes)


def test_a_verify_step_emits_its_positions_less_its_rejected_drafts_and_its_useful_flops_are_theirs() -> None:
    # 4 sequences × (3 drafts + 1) = 16 positions, 12 drafted, 6 accepted: 6 rejected, 10 emitted.
    assert emitted_tokens(16, 6) == 10
    # More rejected than positions (an engine's count past a request's end): none, never fewer.
    assert emitted_tokens(4, 9) == 0
    # 10 of 16 positions' share of 1,600 FLOPs is useful: 1,000; the other 600 are the rejected drafts'.
    assert useful_flops(1600.0, 16, 10) == 1000.0
    assert useful_flops(1600.0, 0, 0) == 0.0


def test_a_draft_model_costs_k_decode_steps_of_its_own_and_host_code_nothing() -> None:
    # k = 3 draft steps of the toy model itself for 2 sequences holding 2,000 tokens: each step 5,024,000
    # FLOPs and 5,024,000 + 1,024 bytes moved.
    assert draft_work(Drafter(3, TOY), 2, 2000) == (3 * 5_024_000, 3 * 5_025_024)
    assert draft_work(Drafter(3), 2, 2000) == (0.0, 0.0)
    assert draft_work(Drafter(3, TOY), 0, 0) == (0.0, 0.0)


def test_the_calculator_s_draft_step_is_the_same_draftas_the_attribution_s() -> None:
    # A draft step of the toy model for 2 sequences at context 1,000: its roofline time over the bytes it reads,
    # 5,024,000 ÷ 100 GB/s = 50.24 µs, above its 5,024,000 FLOPs ÷ 1 TFLOP/s = 5.024 µs.
    draft = decode_work(TOY, 2, 2000)
    seconds = draft_step_seconds(TOY, PEAKS, "fp32", 2, 1000, Drafter(model=TOY))
    assert seconds == max(draft.read_bytes / 100e9, draft.flops / 1e12)
    assert seconds == pytest.approx(50.24e-6)


def test_the_drafter_s_part_of_a_step_s_time_is_its_share_of_the_roofline_time() -> None:
    # 50 ms measured; the verify work 3 units of roofline time, the drafter's 1: a quarter, 12.5 ms.
    assert drafter_seconds(0.05, 3.0, 1.0) == pytest.approx(0.0125)
    assert drafter_seconds(0.05, 0.0, 0.0) == 0.0
