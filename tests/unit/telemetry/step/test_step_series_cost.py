"""The step series kept cheaply (`children.SumCounter`, `histograms.observe_all`'s one-value path) read exactly
as prometheus-client's own `Counter.inc` and `Histogram.observe` would have made them."""

from __future__ import annotations

import contextlib
import math
import random
import re
import threading
from collections.abc import Iterator

import pytest
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    enable_created_metrics,
    metrics,
)
from prometheus_client.exposition import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from phasescope.telemetry.children import SumCounter
from phasescope.telemetry.histograms import observe_all
from phasescope.telemetry.step.prometheus import INTER_TOKEN_SECONDS_BUCKETS

HELP = "Modelled FLOPs per phase; ÷ steps is per step."
LABELS = ("model", "engine", "phase")


def increments(seed: int) -> list[tuple[float, tuple[str, str, str]]]:
    """Amounts of every kind a step adds (whole counts, seconds, FLOPs, 0) to series first touched in turn."""
    rng = random.Random(seed)
    series = [("m", str(engine), phase) for engine in (1, 0) for phase in ("decode", "prefill")]
    return [
        (
            rng.choice([1, 0, rng.uniform(0.0, 0.05), rng.uniform(1e6, 1e12), float(rng.randint(1, 256))]),
            rng.choice(series),
        )
        for _ in range(2000)
    ]


def exported(counter_class: type, amounts: list[tuple[float, tuple[str, str, str]]]) -> Iterator[str]:
    """The text and OpenMetrics exposition of a family fed `amounts`, each `_created` instant (wall clock, made
    when the series was) read as CREATED."""
    registry = CollectorRegistry()
    if counter_class is Counter:
        counter = Counter("phasescope_model_flops", HELP, LABELS, registry=registry)
        counter.labels("m", "2", "decode")  # a series made before any increment, as StepMetrics makes some
        for amount, labels in amounts:
            counter.labels(*labels).inc(amount)
    else:
        sums = SumCounter("phasescope_model_flops", HELP, LABELS)
        registry.register(sums)
        sums.labels("m", "2", "decode")
        for amount, labels in amounts:
            sums.inc(amount, *labels)
    openmetrics: bytes = generate_openmetrics(registry)  # type: ignore[no-untyped-call]  # unannotated upstream
    for text in (generate_latest(registry), openmetrics):
        yield re.sub(r"(_created\{[^}]*\}) \S+", r"\1 CREATED", text.decode())


@contextlib.contextmanager
def created_series(enabled: bool) -> Iterator[None]:
    """prometheus-client's created series on or off (a process-wide switch: the server turns them off), then as
    they were."""
    was = metrics._use_created
    (enable_created_metrics if enabled else disable_created_metrics)()  # type: ignore[no-untyped-call]
    try:
        yield
    finally:
        (enable_created_metrics if was else disable_created_metrics)()  # type: ignore[no-untyped-call]


def test_a_sum_counter_exports_what_a_counter_fed_the_same_increments_does() -> None:
    amounts = increments(seed=3)
    with created_series(enabled=True):
        expected, got = list(exported(Counter, amounts)), list(exported(SumCounter, amounts))
    assert got == expected
    assert "phasescope_model_flops_created" in got[0]
    assert 'phasescope_model_flops_total{engine="2",model="m",phase="decode"} 0.0' in got[0]


def test_a_sum_counter_leaves_out_created_series_when_prometheus_client_does() -> None:
    amounts = increments(seed=4)
    with created_series(enabled=False):  # as the server has them
        expected, got = list(exported(Counter, amounts)), list(exported(SumCounter, amounts))
    assert got == expected
    assert "_created" not in got[0]


def test_a_sum_counter_refuses_what_a_counter_refuses() -> None:
    registry = CollectorRegistry()
    sums = SumCounter("phasescope_engine_steps", "Steps.", ["model", "engine"])
    registry.register(sums)
    with pytest.raises(ValueError, match="non-negative"):
        sums.inc(-1.0, "m", "0")
    with pytest.raises(ValueError, match="label values"):
        sums.inc(1.0, "m")
    with pytest.raises(ValueError, match="Duplicated"):  # its names are known to the registry, as a Counter's are
        Counter("phasescope_engine_steps", "Steps.", ["model", "engine"], registry=registry)
    assert registry.get_sample_value("phasescope_engine_steps_total", {"model": "m", "engine": "0"}) == 0.0


def test_a_scrape_while_series_are_made_and_added_to_reads_each_whole() -> None:
    registry = CollectorRegistry()
    sums = SumCounter("phasescope_engine_step_tokens", "Tokens.", ["model", "engine"])
    registry.register(sums)
    done = threading.Event()
    scraped: list[bytes] = []

    def scrape() -> None:
        while not done.is_set():
            scraped.append(generate_latest(registry))

    scraper = threading.Thread(target=scrape)
    scraper.start()
    try:
        for step in range(20_000):
            sums.inc(1, "m", str(step % 500))  # new series keep coming while the scraper copies them
    finally:
        done.set()
        scraper.join()
    assert scraped
    for engine in ("0", "499"):
        assert registry.get_sample_value("phasescope_engine_step_tokens_total", {"model": "m", "engine": engine}) == 40


def histogram_samples(values: list[list[float]], at_once: bool) -> dict[tuple[str, str], float]:
    registry = CollectorRegistry()
    histogram = Histogram("itl_seconds", "gaps", ["model"], buckets=INTER_TOKEN_SECONDS_BUCKETS, registry=registry)
    child = histogram.labels("m")
    for step in values:
        if at_once:
            observe_all(child, step)
        else:
            for value in step:
                child.observe(value)
    return {
        (sample.name, sample.labels.get("le", "")): sample.value
        for family in registry.collect()
        for sample in family.samples
        if not sample.name.endswith("_created")
    }


def test_a_steps_gaps_of_one_value_count_and_sum_as_observed_one_by_one() -> None:
    # A steady decode step's gaps are one value (each request got its previous token from the previous step):
    # counted in one bucket at once, on a bound itself, beyond the last finite bound, 0, -0.0, and the sum added
    # up amount by amount (the same value added k times is not k × the value, to the bit).
    rng = random.Random(5)
    steps = [[rng.uniform(0.001, 0.1)] * rng.randint(1, 128) for _ in range(300)]
    steps += [[0.015] * 64, [80.0] * 3, [100.0] * 5, [math.inf] * 2, [0.0] * 4, [-0.0] * 4, [1 / 3] * 7, [0.015]]
    steps += [[0.02] * 63 + [0.03], [0.03, 0.02, 0.02]]  # one apart: counted as any mixed batch is
    rng.shuffle(steps)
    expected, got = histogram_samples(steps, at_once=False), histogram_samples(steps, at_once=True)
    assert got == expected
    assert got[("itl_seconds_count", "")] == sum(len(step) for step in steps)


def test_a_steps_gaps_that_are_all_nan_count_in_no_bucket() -> None:
    nan = math.nan
    steps = [[0.02, 0.02], [nan] * 3, [0.5]]
    expected, got = histogram_samples(steps, at_once=False), histogram_samples(steps, at_once=True)
    assert math.isnan(expected.pop(("itl_seconds_sum", "")))
    assert math.isnan(got.pop(("itl_seconds_sum", "")))
    assert got == expected
    assert got[("itl_seconds_count", "")] == 3
