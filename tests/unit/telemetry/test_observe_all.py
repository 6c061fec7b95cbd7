"""observe_all: a histogram fed a held batch at once reads as one observe() per amount, in order; observe_counted:
each distinct amount with its count reads as that many observe() calls."""

import math
import random

import pytest
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.exposition import generate_latest

from phasescope.telemetry.histograms import observe_all, observe_counted

BUCKETS = (0.01, 0.025, 0.05, 0.1)


def exposition(values: list[float], bulk: bool) -> bytes:
    registry = CollectorRegistry()
    histogram = Histogram("itl_seconds", "gaps", ["model"], buckets=BUCKETS, registry=registry)
    child = histogram.labels("m")
    if bulk:
        observe_all(child, values)
    else:
        for value in values:
            child.observe(value)
    lines = generate_latest(registry).splitlines()
    return b"\n".join(line for line in lines if not line.startswith(b"itl_seconds_created"))


def test_bulk_observation_equals_one_observe_per_value() -> None:
    # On a bound (le is inclusive), between bounds, beyond the last finite bound, zero, negative.
    values = [0.01, 0.0101, 0.025, 0.03, 0.05, 0.1, 0.1000001, 7.0, 0.0, -0.001, 0.01]
    assert exposition(values, bulk=True) == exposition(values, bulk=False)
    assert b'itl_seconds_bucket{le="0.01",model="m"} 4.0' in exposition(values, bulk=True)
    assert b'itl_seconds_count{model="m"} 11.0' in exposition(values, bulk=True)


def test_no_values_observe_nothing() -> None:
    assert exposition([], bulk=True) == exposition([], bulk=False)
    assert b'itl_seconds_count{model="m"} 0.0' in exposition([], bulk=True)


BOUNDS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0)


def histogram(registry: CollectorRegistry) -> Histogram:
    return Histogram("latency_seconds", "latency", ["engine"], buckets=BOUNDS, registry=registry).labels("0")


def samples(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
    return {
        (sample.name, sample.labels.get("le", "")): sample.value
        for family in registry.collect()
        for sample in family.samples
        if not sample.name.endswith("_created")
    }


def test_observing_all_at_once_counts_and_sums_as_observing_each_in_turn() -> None:
    # Held inter-token latencies are observed a batch at a time: vLLM's series must read exactly as if vLLM had
    # observed each one, on the bucket bounds themselves, beyond the last, below the first, and NaN included.
    rng = random.Random(7)
    amounts = [rng.uniform(0.0, 1.2) for _ in range(5000)]
    amounts += [*BOUNDS, math.inf, -0.5, 0.0, math.nan, math.nextafter(0.01, 1.0), math.nextafter(0.01, 0.0)]
    rng.shuffle(amounts)
    one_by_one, all_at_once = CollectorRegistry(), CollectorRegistry()
    each, batch = histogram(one_by_one), histogram(all_at_once)
    each.observe(0.25)
    batch.observe(0.25)
    for amount in amounts:
        each.observe(amount)
    observe_all(batch, amounts[:1000])
    observe_all(batch, amounts[1000:])
    observe_all(batch, [])
    expected, got = samples(one_by_one), samples(all_at_once)
    assert math.isnan(expected[("latency_seconds_sum", "")])
    assert math.isnan(got[("latency_seconds_sum", "")])
    del expected[("latency_seconds_sum", "")], got[("latency_seconds_sum", "")]
    assert got == expected
    # The first 0.25 and every amount but NaN, which observe() puts in no bucket.
    assert got[("latency_seconds_count", "")] == 1 + len(amounts) - 1


def test_the_sum_is_the_same_to_the_bit() -> None:
    rng = random.Random(11)
    amounts = [rng.lognormvariate(-4.0, 1.0) for _ in range(3000)]
    one_by_one, all_at_once = CollectorRegistry(), CollectorRegistry()
    each, batch = histogram(one_by_one), histogram(all_at_once)
    for amount in amounts:
        each.observe(amount)
    observe_all(batch, amounts)
    assert samples(all_at_once)[("latency_seconds_sum", "")] == samples(one_by_one)[("latency_seconds_sum", "")]


def each_and_counted(
    amounts: list[float], counts: list[int], split: int
) -> tuple[dict[tuple[str, str], float], dict[tuple[str, str], float]]:
    """The samples of a histogram observed `count` times per amount, one by one, and of one fed the amounts with
    their counts by `observe_counted` in two parts (at `split`) and an empty one."""
    one_by_one, counted = CollectorRegistry(), CollectorRegistry()
    each, batch = histogram(one_by_one), histogram(counted)
    for amount, count in zip(amounts, counts, strict=True):
        for _ in range(count):
            each.observe(amount)
    observe_counted(batch, amounts[:split], counts[:split])
    observe_counted(batch, amounts[split:], counts[split:])
    observe_counted(batch, [], [])
    return samples(one_by_one), samples(counted)


def test_each_distinct_gap_with_its_count_reads_as_that_many_observations() -> None:
    # An engine step's inter-token gaps come as runs of one gap and their lengths: on the bounds,
    # between them, beyond the last, below the first, and NaN, which observe() puts in no bucket.
    rng = random.Random(5)
    amounts = [rng.uniform(0.0, 1.2) for _ in range(200)]
    amounts += [*BOUNDS, math.inf, -0.5, 0.0, math.nan, math.nextafter(0.01, 1.0), math.nextafter(0.01, 0.0)]
    counts = [rng.randint(1, 64) for _ in amounts]
    expected, got = each_and_counted(amounts, counts, 100)
    assert math.isnan(got.pop(("latency_seconds_sum", "")))
    assert math.isnan(expected.pop(("latency_seconds_sum", "")))
    assert got == expected
    # Every amount's count but NaN's, which observe() puts in no bucket.
    assert got[("latency_seconds_count", "")] == sum(counts) - counts[amounts.index(math.nan)]


def test_the_counted_sum_agrees_to_rounding() -> None:
    rng = random.Random(13)
    amounts = [rng.lognormvariate(-4.0, 1.0) for _ in range(300)]
    counts = [rng.randint(1, 128) for _ in amounts]
    expected, got = each_and_counted(amounts, counts, len(amounts))
    assert got[("latency_seconds_sum", "")] == pytest.approx(expected[("latency_seconds_sum", "")], rel=1e-12)
    assert got[("latency_seconds_count", "")] == sum(counts)
