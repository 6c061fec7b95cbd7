import math
import random

from prometheus_client import CollectorRegistry, Histogram

from phasescope.telemetry.held import observe_all

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
    assert math.isnan(expected[("latency_seconds_sum", "")]) and math.isnan(got[("latency_seconds_sum", "")])
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
