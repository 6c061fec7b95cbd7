"""Speculative decoding in the calculator: tokens per verify step, the verify step's roofline, and when it pays.

Every figure is derived by hand in the comments. The drafter is free (an n-gram drafter: the upper
bound) unless a test gives it a cost (a draft model, or a share c of the decode step), and each
drafted token is accepted with the same probability a, independently.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from phasescope.telemetry.hardware.peaks import HardwarePeaks, lookup_device
from phasescope.telemetry.model.cost import model_cost_from_config, model_cost_from_numbers
from phasescope.telemetry.model.roofline import decode_step, roofline
from phasescope.telemetry.model.speculation import (
    FREE_DRAFTER,
    MAX_SPECULATIVE_TOKENS,
    Drafter,
    best_speculative_tokens,
    draft_step_seconds,
    expected_tokens_per_step,
    speculation,
    speculative_speedup,
    stops_helping_batch_size,
    verify_step,
)
from support.model_configs import LLAMA_3_1_8B, LLAMA_3_1_70B, MIXTRAL_8X7B


def datasheet(name: str) -> HardwarePeaks:
    peaks = lookup_device(name)
    assert peaks is not None, name
    return peaks


H100 = datasheet("h100-sxm")


def test_expected_tokens_per_step_is_the_geometric_sum_of_acceptances() -> None:
    # E = 1 + a + … + aᵏ = (1 − a^(k+1)) ÷ (1 − a). At a = 0.7, k = 4: 0.7⁵ = 0.16807,
    # (1 − 0.16807) ÷ 0.3 = 0.83193 ÷ 0.3 = 2.7731.
    assert expected_tokens_per_step(0.7, 4) == pytest.approx(2.7731)
    # One draft: the draft with probability a, plus the step's own token.
    assert expected_tokens_per_step(0.5, 1) == pytest.approx(1.5)
    # Nothing accepted: one token per step, as plain decode.
    assert expected_tokens_per_step(0.0, 8) == 1.0
    # As k grows, E approaches 1 ÷ (1 − a) = 3.333… at a = 0.7: at k = 16, (1 − 0.7¹⁷) ÷ 0.3 = 3.3256.
    assert expected_tokens_per_step(0.7, 16) == pytest.approx(3.3256, abs=1e-4)


@pytest.mark.parametrize(
    ("acceptance_rate", "speculative_tokens", "named"),
    [(1.0, 4, "acceptance_rate"), (-0.1, 4, "acceptance_rate"), (0.7, 0, "speculative_tokens")],
)
def test_an_acceptance_rate_outside_0_to_1_or_no_drafts_is_refused_by_name(
    acceptance_rate: float, speculative_tokens: int, named: str
) -> None:
    with pytest.raises(ValueError, match=named):
        expected_tokens_per_step(acceptance_rate, speculative_tokens)


def test_a_verify_step_with_no_drafts_is_the_plain_decode_step() -> None:
    cost = model_cost_from_config(LLAMA_3_1_70B, None, "bfloat16").sharded(4, 1)
    for batch in (1, 64, 1024):
        plain = decode_step(cost, H100, "bf16", batch, 1024)
        verify = verify_step(cost, H100, "bf16", batch, 1024, 0)
        assert (verify.bytes_per_step, verify.flops_per_step, verify.step_seconds, verify.bound) == (
            plain.bytes_per_step,
            plain.flops_per_step,
            plain.step_seconds,
            plain.bound,
        )


def test_the_verify_step_has_k_plus_one_times_decode_s_intensity_at_the_same_step_time_while_memory_bound() -> None:
    # Llama 3.1 70B, TP 4, context 1024, batch 1, per H100. Decode: bytes = 35,276,853,248 of weights +
    # 1,024 × 81,920 of KV = 35,360,739,328; FLOPs = 34,751,516,672 (2 × non-embedding parameters and
    # the LM head, ÷ 4) + 4 × 80 × 8,192 × 1,024 ÷ 4 of attention (671,088,640) = 35,422,605,312:
    # 1.0017 FLOP/byte. Verify, k = 4: the same bytes (weights once, the KV once for its 5 positions);
    # FLOPs = 5 × 34,751,516,672 + 2,621,440 × (5 × 1,024 + 4 × 5 ÷ 2 = 5,130 pairs) = 177,119,580,160:
    # 5.0089 FLOP/byte, 5.0002 × decode's (the extra attention pairs are the 0.02 %).
    cost = model_cost_from_config(LLAMA_3_1_70B, None, "bfloat16").sharded(4, 1)
    plain = decode_step(cost, H100, "bf16", 1, 1024)
    verify = verify_step(cost, H100, "bf16", 1, 1024, 4)
    assert verify.bytes_per_step == plain.bytes_per_step == 35_360_739_328
    assert verify.flops_per_step == 177_119_580_160
    assert verify.arithmetic_intensity_flops_per_byte == pytest.approx(
        5 * plain.arithmetic_intensity_flops_per_byte, rel=1e-3
    )
    # Both far below the ridge (295 FLOP/byte): the step lasts as long as the bytes take, drafts or not.
    assert (plain.bound, verify.bound) == ("memory", "memory")
    assert verify.step_seconds == plain.step_seconds


def test_70b_at_tensor_parallel_2_on_h100_gains_2_77x_per_sequence_until_batch_164() -> None:
    # 70e9 parameters in bf16 over TP 2: each H100 reads 70 GB per step at 3.35e12 B/s and does 70 GFLOP
    # per token at 989e12 FLOP/s (the whole deployment: 6.7e12 B/s and 1,978e12 FLOP/s on 140 GB).
    # With no KV figure: decode step(B) = max(70e9 ÷ 3.35e12 = 20.896 ms, B × 70e9 ÷ 989e12 = B × 70.78 µs);
    # the verify step at k = 4 is the same with 5B tokens: max(20.896 ms, 5B × 70.78 µs).
    # E = 2.7731 (a = 0.7, k = 4).
    # · B < 20.896 ms ÷ (5 × 70.78 µs) = 295.22 ÷ 5 = 59.04: both memory-bound, same step time: E × plain.
    # · 59.04 ≤ B < 295.2: decode still 20.896 ms, verify 5B × 70.78 µs. Speculation helps while
    #   E ÷ (5B × 70.78 µs) > 1 ÷ 20.896 ms, i.e. B < E × 59.04 = 163.74: it stops helping at batch 164.
    # · B ≥ 295.2: both compute-bound, speedup = E ÷ 5 = 0.55.
    # Best k at batch 1: 5 × 70.78 µs ≪ 20.896 ms for every k ≤ 16 (k + 1 < 295), so the step time is flat
    # in k and E grows with k: the best is the search's bound, k = 16, E = 3.3256.
    cost = model_cost_from_numbers(70_000_000_000, "bf16").sharded(2, 1)
    assert speculative_speedup(cost, H100, "bf16", 1, 0, 4, 0.7) == pytest.approx(2.7731)
    assert speculative_speedup(cost, H100, "bf16", 163, 0, 4, 0.7) > 1
    assert speculative_speedup(cost, H100, "bf16", 164, 0, 4, 0.7) <= 1
    assert speculative_speedup(cost, H100, "bf16", 512, 0, 4, 0.7) == pytest.approx(2.7731 / 5)
    assert stops_helping_batch_size(cost, H100, "bf16", 0, 4, 0.7, 512) == 164
    assert best_speculative_tokens(cost, H100, "bf16", 0, 0.7) == 16
    report = roofline(cost, H100, "bf16", batch_sizes=(1, 64, 256), speculative_tokens=4, acceptance_rate=0.7)
    spec = report.speculation
    assert spec is not None
    assert spec.speculative_tokens_per_step == pytest.approx(2.7731)
    assert (spec.best_speculative_tokens, spec.best_speculative_tokens_batch_size) == (16, 1)
    assert spec.best_speculative_tokens_per_step == pytest.approx(3.3256, abs=1e-4)
    assert spec.speculation_stops_helping_batch_size == 164
    one, sixty_four, two_fifty_six = spec.rows
    # Batch 1: 2.7731 tokens per 20.896 ms = 132.71 tok/s per sequence, against plain decode's 47.86.
    assert one.speculative_tokens_per_second_per_sequence == pytest.approx(2.7731 * 3.35e12 / 70e9)
    assert one.speculative_arithmetic_intensity_flops_per_byte == pytest.approx(5.0)
    # Batch 64: 320 tokens per weight read, past the ridge: 320 × 70.78 µs = 22.65 ms, speedup
    # 2.7731 × 20.896 ÷ 22.65 = 2.56. Batch 256: 1,280 × 70.78 µs = 90.6 ms, speedup 0.64.
    assert (sixty_four.speculative_bound, sixty_four.speculation_helps) == ("compute", True)
    assert sixty_four.speculative_speedup_ratio == pytest.approx(2.7731 * 295.22 / 320, rel=1e-4)
    assert two_fifty_six.speculation_helps is False
    assert two_fifty_six.speculative_speedup_ratio == pytest.approx(2.7731 * 295.22 / 1280, rel=1e-4)


def test_the_best_k_is_where_the_verify_step_reaches_the_compute_roof() -> None:
    # A device with a ridge point of 4 FLOP/byte (1e12 B/s, 4e12 FLOP/s) and a 1B bf16 model: 2 GB read,
    # 2 GFLOP per token, 1 FLOP/byte per token. Batch 1's verify step stays memory-bound (2 ms) while
    # k + 1 ≤ 4; beyond, it lasts (k + 1) × 0.5 ms. Emitted tok/s at a = 0.7: k = 3, E = (1 − 0.7⁴) ÷ 0.3
    # = 2.533 per 2 ms = 1,266.5; k = 4, E = 2.7731 per 2.5 ms = 1,109.2; more k only adds less than
    # the step grows. Best: k = 3.
    peaks = HardwarePeaks("toy", 1e12, {"bf16": 4e12}, "flag")
    cost = model_cost_from_numbers(1_000_000_000, "bf16")
    assert best_speculative_tokens(cost, peaks, "bf16", 0, 0.7) == 3


def test_a_mixture_of_experts_drafts_read_more_experts_so_speculation_starts_paying_at_batch_2() -> None:
    # Mixtral 8x7B on one H200 (4.8e12 B/s), context 0, k = 4, a = 0.7. One token reads the dense parts
    # and 2 of 8 experts per layer: 25,759,850,496 bytes. The verify step's 5 tokens touch
    # 8 × (1 − (6/8)⁵) = 6.10 experts per layer on average: 72,002,052,096 bytes. Both memory-bound, so
    # speedup = E × 25.76 ÷ 72.00 = 2.7731 × 0.35777 = 0.992: at batch 1 speculation does not pay.
    # At batch 2 decode's 2 tokens already touch 3.5 experts per layer and the gap narrows: 1.34.
    h200 = datasheet("h200")
    cost = model_cost_from_config(MIXTRAL_8X7B, None, "bfloat16")
    assert cost.weights_read(1) == 25_759_850_496
    assert cost.weights_read(5) == pytest.approx(72_002_052_096)
    assert speculative_speedup(cost, h200, "bf16", 1, 0, 4, 0.7) == pytest.approx(
        2.7731 * 25_759_850_496 / 72_002_052_096
    )
    assert speculative_speedup(cost, h200, "bf16", 2, 0, 4, 0.7) > 1
    # So "where speculation stops helping" counts from where it stops for good, not from batch 1: up to
    # batch 128 every batch from 2 on gains (by batch 32 every expert is read either way: E × 1).
    assert stops_helping_batch_size(cost, h200, "bf16", 0, 4, 0.7, 128) is None


def test_json_carries_speculation_at_top_level_and_in_each_row() -> None:
    cost = model_cost_from_numbers(70_000_000_000, "bf16").sharded(2, 1)
    data = roofline(cost, H100, "bf16", batch_sizes=(1, 2), speculative_tokens=4, acceptance_rate=0.7).to_json()
    assert "speculation" not in data
    assert (data["speculative_tokens"], data["acceptance_rate"]) == (4, 0.7)
    for key in (
        "speculative_tokens_per_step",
        "best_speculative_tokens",
        "best_speculative_tokens_batch_size",
        "best_speculative_tokens_per_step",
        "speculation_stops_helping_batch_size",
    ):
        assert key in data
    for key in (
        "speculative_step_seconds",
        "speculative_tokens_per_second_per_sequence",
        "speculative_tokens_per_second_total",
        "speculative_achieved_flops_per_second",
        "speculative_arithmetic_intensity_flops_per_byte",
        "speculative_bound",
        "speculative_speedup_ratio",
        "speculation_helps",
    ):
        assert key in data["rows"][0]
    assert data["rows"][1]["batch_size"] == 2
    # Without the flags the JSON is as it was: no speculative fields.
    plain = roofline(cost, H100, "bf16", batch_sizes=(1,)).to_json()
    assert not [key for key in plain if "speculat" in key]
    assert not [key for key in plain["rows"][0] if "speculat" in key]


def test_speculative_tokens_without_an_acceptance_rate_is_refused() -> None:
    cost = model_cost_from_numbers(1_000_000_000, "bf16")
    with pytest.raises(ValueError, match="go together"):
        roofline(cost, H100, "bf16", speculative_tokens=4)


# The drafter's cost: k draft steps, one token per sequence each, before every verify step.

SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "num_hidden_layers": 30,
    "head_dim": 64,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
}


@pytest.mark.parametrize("draft_cost", [0.02, 0.05, 0.1, 0.3])
@pytest.mark.parametrize("speculative_tokens", [1, 4, 8])
def test_a_draft_cost_c_gives_leviathan_s_speedup_while_the_verify_step_is_memory_bound(
    draft_cost: float, speculative_tokens: int
) -> None:
    # SmolLM2-135M on an H100 at batch 1, context 1,024: 0.27 GB of weights and 23 MB of KV per step against
    # 0.27 GFLOP per position: the verify step of k + 1 ≤ 9 positions stays far below the ridge (295), so
    # it lasts the decode step t. A round = t + k × c × t, and the sequence emits E per round against
    # plain decode's 1 per t: speedup = E ÷ (1 + k × c) (Leviathan et al. 2023, eq. 1 with the verify
    # step's own cost 1).
    cost = model_cost_from_config(SMOLLM2_135M, None, "bfloat16")
    assert verify_step(cost, H100, "bf16", 1, 1024, speculative_tokens).bound == "memory"
    drafter = Drafter(cost_ratio=draft_cost)
    emitted = expected_tokens_per_step(0.7, speculative_tokens)
    speedup = speculative_speedup(cost, H100, "bf16", 1, 1024, speculative_tokens, 0.7, drafter)
    assert speedup == pytest.approx(emitted / (1 + speculative_tokens * draft_cost), rel=1e-12)
    # The k draft steps: k × c × the decode step.
    plain = decode_step(cost, H100, "bf16", 1, 1024).step_seconds
    (row,) = speculation(cost, H100, "bf16", (1,), 1024, speculative_tokens, 0.7, drafter).rows
    assert row.speculative_draft_seconds == pytest.approx(speculative_tokens * draft_cost * plain, rel=1e-12)
    assert row.speculative_tokens_per_second_per_sequence == pytest.approx(
        emitted / (plain * (1 + speculative_tokens * draft_cost)), rel=1e-12
    )


def test_a_costly_drafter_has_an_interior_best_k() -> None:
    # At a = 0.7 with c = 0.05 and a memory-bound verify step, tok/s ∝ E(k) ÷ (1 + 0.05 k): k = 4: 2.7731 ÷ 1.2
    # = 2.3109; k = 5: 2.9412 ÷ 1.25 = 2.35294; k = 6: 3.0588 ÷ 1.3 = 2.35294 (2 × 10⁻⁶ more); k = 7:
    # 3.1412 ÷ 1.35 = 2.3268; from there E gains less than 0.7ᵏ⁺¹ while the round grows by 0.05. Best: 6.
    # A free drafter's best is the search's bound, 16; c = 0.1 moves it to 4 (1.9808 against 1.9485 at 3).
    cost = model_cost_from_config(SMOLLM2_135M, None, "bfloat16")
    assert best_speculative_tokens(cost, H100, "bf16", 1024, 0.7) == MAX_SPECULATIVE_TOKENS == 16
    assert best_speculative_tokens(cost, H100, "bf16", 1024, 0.7, Drafter(cost_ratio=0.05)) == 6
    assert best_speculative_tokens(cost, H100, "bf16", 1024, 0.7, Drafter(cost_ratio=0.1)) == 4
    spec = speculation(cost, H100, "bf16", (1,), 1024, 4, 0.7, Drafter(cost_ratio=0.05))
    assert (spec.best_speculative_tokens, spec.draft_cost_ratio, spec.draft_model) == (6, 0.05, None)
    assert spec.best_speculative_tokens_per_step == pytest.approx(3.0588, abs=1e-4)


def test_a_draft_cost_moves_where_speculation_stops_helping_earlier() -> None:
    # 70B at TP 2 on H100s, k = 4, a = 0.7 (test_70b_at_tensor_parallel_2_…): decode lasts t = 20.896 ms to
    # batch 295, the verify step 5B × 70.78 µs from batch 59. With c = 0.05 a round adds 4 × 0.05 × t, so
    # speculation helps while E × t > 5B × 70.78 µs + 0.2 t, i.e. B < (E − 0.2) × 59.04 = 151.93: it stops
    # helping at batch 152 instead of 164.
    cost = model_cost_from_numbers(70_000_000_000, "bf16").sharded(2, 1)
    drafter = Drafter(cost_ratio=0.05)
    assert stops_helping_batch_size(cost, H100, "bf16", 0, 4, 0.7, 512) == 164
    assert stops_helping_batch_size(cost, H100, "bf16", 0, 4, 0.7, 512, drafter) == 152
    assert speculative_speedup(cost, H100, "bf16", 151, 0, 4, 0.7, drafter) > 1
    assert speculative_speedup(cost, H100, "bf16", 152, 0, 4, 0.7, drafter) <= 1


def test_the_target_as_its_own_draft_model_costs_a_decode_step_per_draft_and_never_pays() -> None:
    # Each draft step is the target's own decode step: c = 1 exactly, and at batch 1 the round lasts
    # (1 + k) decode steps for E tokens: 2.7731 ÷ 5 = 0.555 ×. No k helps (E(k) < 1 + k): best k = 1.
    cost = model_cost_from_config(SMOLLM2_135M, None, "bfloat16")
    itself = Drafter(model=cost, name="SmolLM2-135M")
    assert (
        draft_step_seconds(cost, H100, "bf16", 1, 1024, itself) == decode_step(cost, H100, "bf16", 1, 1024).step_seconds
    )
    spec = speculation(cost, H100, "bf16", (1, 64), 1024, 4, 0.7, itself)
    assert spec.draft_cost_ratio == pytest.approx(1.0, rel=1e-12)
    assert spec.draft_model == "SmolLM2-135M"
    assert spec.rows[0].speculative_speedup_ratio == pytest.approx(2.7731 / 5, rel=1e-4)
    assert not any(row.speculation_helps for row in spec.rows)
    assert spec.best_speculative_tokens == 1
    assert spec.speculation_stops_helping_batch_size == 1


def test_a_small_draft_model_costs_its_own_decode_step() -> None:
    # Llama 3.1 8B drafting for Llama 3.1 70B, both over TP 4 on H100s, context 1,024: both decode steps are
    # memory-bound at batch 1, so c = the 8B's bytes per step ÷ the 70B's (its own weights and its own KV:
    # 32 layers × 8 KV heads × 128 × 2 × 2 bytes = 128 KiB a token, ÷ 4): 4,048,685,056 ÷ 35,360,739,328
    # = 0.1145. Speedup at k = 4, a = 0.7: 2.7731 ÷ (1 + 4 × 0.1145) = 1.90, not the free drafter's 2.77.
    target = model_cost_from_config(LLAMA_3_1_70B, None, "bfloat16").sharded(4, 1)
    draft = model_cost_from_config(LLAMA_3_1_8B, None, "bfloat16").sharded(4, 1)
    drafter = Drafter(model=draft, name="llama-3.1-8b")
    plain, drafted = decode_step(target, H100, "bf16", 1, 1024), decode_step(draft, H100, "bf16", 1, 1024)
    assert (plain.bound, drafted.bound) == ("memory", "memory")
    spec = speculation(target, H100, "bf16", (1,), 1024, 4, 0.7, drafter)
    assert spec.draft_cost_ratio == pytest.approx(drafted.bytes_per_step / plain.bytes_per_step, rel=1e-12)
    assert spec.draft_cost_ratio == pytest.approx(4_048_685_056 / 35_360_739_328, rel=1e-12)
    (row,) = spec.rows
    assert row.speculative_draft_seconds == pytest.approx(4 * drafted.step_seconds, rel=1e-12)
    assert row.speculative_speedup_ratio == pytest.approx(2.7731 / (1 + 4 * spec.draft_cost_ratio), rel=1e-3)


def test_a_drafter_is_a_model_or_a_ratio_of_at_least_0() -> None:
    cost = model_cost_from_numbers(1_000_000_000, "bf16")
    with pytest.raises(ValueError, match="draft cost ratio must be a finite number ≥ 0"):
        Drafter(cost_ratio=-0.1)
    with pytest.raises(ValueError, match="draft cost ratio must be a finite number ≥ 0"):
        Drafter(cost_ratio=float("nan"))
    with pytest.raises(ValueError, match="not both"):
        Drafter(model=cost, cost_ratio=0.1)
    assert FREE_DRAFTER.free
    assert not Drafter(cost_ratio=0.1).free
    assert not Drafter(model=cost).free


def test_json_carries_the_drafter_at_top_level_and_its_draft_seconds_in_each_row() -> None:
    cost = model_cost_from_numbers(70_000_000_000, "bf16").sharded(2, 1)
    report = roofline(cost, H100, "bf16", batch_sizes=(1, 2), speculative_tokens=4, acceptance_rate=0.7)
    # roofline() alone assumes the free drafter: c = 0, no model, no draft seconds.
    data = report.to_json()
    assert (data["draft_cost_ratio"], data["draft_model"]) == (0.0, None)
    assert [row["speculative_draft_seconds"] for row in data["rows"]] == [0.0, 0.0]
    spec = speculation(cost, H100, "bf16", (1, 2), 0, 4, 0.7, Drafter(cost_ratio=0.05))
    data = replace(report, speculation=spec).to_json()
    assert (data["draft_cost_ratio"], data["draft_model"]) == (0.05, None)
    # Batch 1: 4 × 0.05 × 20.896 ms = 4.179 ms of drafting per round.
    assert data["rows"][0]["speculative_draft_seconds"] == pytest.approx(4 * 0.05 * 70e9 / 3.35e12)
