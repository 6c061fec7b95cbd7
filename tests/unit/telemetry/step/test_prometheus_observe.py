"""observe_all: the inter-token histogram fed a whole step at once equals one observe() per gap."""

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.exposition import generate_latest

from phasescope.telemetry.step.prometheus import observe_all

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
