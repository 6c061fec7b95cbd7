import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

from phasescope.bench.workload import (
    WORDS,
    LengthDistribution,
    WorkloadError,
    WorkloadSpec,
    derive_seed,
    read_dataset,
    workload,
)

SPEC = WorkloadSpec(LengthDistribution.parse("uniform:10:50"), LengthDistribution.parse("normal:32:8"))


def test_the_same_seed_gives_identical_prompts_and_lengths() -> None:
    assert workload(SPEC, seed=7, count=20) == workload(SPEC, seed=7, count=20)
    assert workload(SPEC, seed=7, count=20) != workload(SPEC, seed=8, count=20)


def test_a_run_seed_is_stable_and_distinct_per_point_and_repeat() -> None:
    # A constant, so a change to the derivation (which would break reproducing old runs) is seen.
    assert derive_seed(0, 0, 0) == derive_seed(0, 0, 0) == 60_670_250_412_800
    seeds = {derive_seed(0, step, repeat) for step in range(10) for repeat in range(5)}
    assert len(seeds) == 50
    assert derive_seed(1, 0, 0) not in seeds


def test_generated_prompts_follow_the_length_distributions() -> None:
    requests = workload(SPEC, seed=1, count=200)
    prompt_words = [len(r.prompt.split()) for r in requests]
    assert min(prompt_words) >= 10
    assert max(prompt_words) <= 50
    outputs = [r.max_tokens for r in requests]
    assert 28 < sum(outputs) / len(outputs) < 36
    assert min(outputs) >= 1
    assert max(outputs) <= 32 + 4 * 8
    # Every word is one of the single-token words, so words ≈ tokens.
    assert {word for r in requests for word in r.prompt.split()} <= set(WORDS)


def test_fixed_lengths_are_exact() -> None:
    spec = WorkloadSpec(LengthDistribution.parse("24"), LengthDistribution.parse("fixed:16"))
    requests = workload(spec, seed=0, count=5)
    assert {len(r.prompt.split()) for r in requests} == {24}
    assert {r.max_tokens for r in requests} == {16}


def test_a_shared_prefix_starts_every_prompt_of_every_run() -> None:
    spec = WorkloadSpec(LengthDistribution.parse("20"), LengthDistribution.parse("8"), shared_prefix_tokens=32)
    first, second = workload(spec, seed=1, count=10), workload(spec, seed=2, count=10)
    prefix = first[0].prompt.split()[:32]
    for request in first + second:
        words = request.prompt.split()
        assert words[:32] == prefix
        assert len(words) == 32 + 20
    # The rest of each prompt differs.
    assert len({" ".join(r.prompt.split()[32:]) for r in first}) == 10


def test_prompts_differ_from_their_first_words_without_a_shared_prefix() -> None:
    requests = workload(SPEC, seed=3, count=50)
    assert len({" ".join(r.prompt.split()[:8]) for r in requests}) == 50


def test_prompts_file_is_read_and_drawn_in_a_seeded_order(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    lines: list[dict[str, str | int]] = [{"prompt": f"question {i}", "max_tokens": 10 + i} for i in range(5)]
    lines.append({"prompt": "no limit"})
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    dataset = read_dataset(path)
    assert len(dataset) == 6
    spec = WorkloadSpec(LengthDistribution.parse("8"), LengthDistribution.parse("7"), dataset=tuple(dataset))
    requests = workload(spec, seed=4, count=12)
    assert requests == workload(spec, seed=4, count=12)
    # Each prompt once per pass through the file.
    assert sorted(r.prompt for r in requests[:6]) == sorted(str(line["prompt"]) for line in lines)
    assert sorted(r.prompt for r in requests[6:]) == sorted(str(line["prompt"]) for line in lines)
    by_prompt = {r.prompt: r.max_tokens for r in requests}
    assert by_prompt["question 3"] == 13
    assert by_prompt["no limit"] == 7


def test_a_shared_prefix_also_leads_prompts_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "hello"}\n')
    spec = WorkloadSpec(LengthDistribution.parse("8"), LengthDistribution.parse("7"), shared_prefix_tokens=4,
                        dataset=tuple(read_dataset(path)))  # fmt: skip
    (request,) = workload(spec, seed=0, count=1)
    assert request.prompt.endswith(" hello")
    assert len(request.prompt.split()) == 5


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "no prompts"),
        ("not json\n", ":1: not JSON"),
        ('{"text": "x"}\n', ':1: each line needs {"prompt"'),
        ('{"prompt": "x"}\n{"prompt": "y", "max_tokens": 0}\n', ":2: max_tokens must be"),
        ('{"prompt": "x", "max_tokens": "8"}\n', "max_tokens must be"),
    ],
)
def test_a_bad_prompts_file_names_its_line(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text(content)
    with pytest.raises(WorkloadError, match=message):
        read_dataset(path)


def test_a_missing_prompts_file_is_a_workload_error(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match="cannot read"):
        read_dataset(tmp_path / "absent.jsonl")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("64", LengthDistribution("fixed", 64)),
        ("fixed:8", LengthDistribution("fixed", 8)),
        ("uniform:16:128", LengthDistribution("uniform", 16, 128)),
        ("normal:64:16", LengthDistribution("normal", 64, 16)),
    ],
)
def test_length_specs_parse(text: str, expected: LengthDistribution) -> None:
    assert LengthDistribution.parse(text) == expected


@pytest.mark.parametrize("text", ["0", "1.5", "uniform:8", "uniform:9:8", "normal:0:1", "normal:8:-1", "poisson:3",
                                  "many", "uniform:a:b"])  # fmt: skip
def test_bad_length_specs_are_rejected(text: str) -> None:
    with pytest.raises(WorkloadError):
        LengthDistribution.parse(text)


def test_normal_lengths_are_clipped_to_at_least_one() -> None:
    distribution = LengthDistribution.parse("normal:2:10")
    rng = random.Random(0)
    samples = [distribution.sample(rng) for _ in range(500)]
    assert min(samples) == 1
    assert max(samples) <= 42


def test_an_adapter_mix_spreads_requests_over_the_adapters_without_changing_the_prompts() -> None:
    from collections import Counter

    from phasescope.bench.workload import AdapterMix

    plain = workload(SPEC, 7, 2000)
    uniform = workload(replace(SPEC, adapters=4, adapter_mix=AdapterMix.parse("uniform")), 7, 2000)
    zipf = workload(replace(SPEC, adapters=4, adapter_mix=AdapterMix.parse("zipf:1.5")), 7, 2000)
    assert [r.prompt for r in uniform] == [r.prompt for r in plain] == [r.prompt for r in zipf]
    assert {r.adapter for r in plain} == {""}
    counts = Counter(r.adapter for r in uniform)
    assert set(counts) == {"adapter-0", "adapter-1", "adapter-2", "adapter-3"}
    assert all(400 < count < 600 for count in counts.values())
    # Zipf, s = 1.5: adapter-0 takes 1 / (1 + 2^-1.5 + 3^-1.5 + 4^-1.5) ≈ 62 % of the requests.
    hot = Counter(r.adapter for r in zipf)
    assert 0.57 < hot["adapter-0"] / 2000 < 0.67
    assert hot["adapter-0"] > hot["adapter-1"] > hot["adapter-2"] > hot["adapter-3"]
    # The same seed, the same draw.
    assert [r.adapter for r in workload(replace(SPEC, adapters=4, adapter_mix=AdapterMix("zipf", 1.5)), 7, 50)] == [
        r.adapter for r in zipf[:50]
    ]
    for bad in ("zipf:0", "zipf:x", "pareto"):
        with pytest.raises(WorkloadError):
            AdapterMix.parse(bad)
