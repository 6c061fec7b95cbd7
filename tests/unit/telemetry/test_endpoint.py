import gzip
import math
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Histogram, Info, Summary, generate_latest
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from phasescope.telemetry.endpoint import CachedExposition, start_metrics_server
from phasescope.telemetry.hardware.peaks import HardwarePeaks
from phasescope.telemetry.model.cost import model_cost_from_config
from phasescope.telemetry.pipeline import TelemetryPipeline
from phasescope.telemetry.request.prometheus import PrometheusRequestObserver
from phasescope.telemetry.step.aggregator import StepAggregator
from phasescope.telemetry.step.prometheus import StepMetrics
from phasescope.telemetry.step.records import SchedulerState, StepRecord, StepReport

PEAKS = HardwarePeaks("toy", 100e9, {"fp32": 1e12}, "measured", "toy device")
COST = model_cost_from_config(
    {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2},
    parameter_count=1_000_000,
    dtype="float32",
)

ACCEPTS = (
    "",
    "text/plain;version=0.0.4",
    "text/plain;version=1.0.0;escaping=dots",
    "application/openmetrics-text;version=1.0.0",
    "application/openmetrics-text; version=1.0.0; escaping=allow-utf-8",
    # What Prometheus 3 sends.
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.5,application/openmetrics-text;"
    "version=0.0.1;q=0.4,text/plain;version=1.0.0;escaping=allow-utf-8;q=0.3,text/plain;version=0.0.4;q=0.2",
)


class Stamped(Collector):
    """Families the cache must leave to the library: a timestamp, OpenMetrics' created series, a unit."""

    def collect(self) -> Iterator[Metric]:
        stamped = GaugeMetricFamily("stamped", "a sample with a timestamp", labels=["k"])
        stamped.add_metric(["a"], 1.5, timestamp=1700000000.25)
        yield stamped
        created = CounterMetricFamily("with_created", "a counter with its created time", labels=["k"])
        created.add_metric(["a"], 3, created=1700000000.0)
        yield created
        yield GaugeMetricFamily("temperature", "a unit", value=21.5, unit="celsius")


class Served:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.observer = PrometheusRequestObserver("tiny")
        self.registry.register(self.observer)
        registry = self.registry
        self.observer.request_started("tiny")
        self.observer.tokens_generated("tiny", 7)
        self.observer.request_rejected("tiny", "overloaded")
        # The step telemetry's families: counters, the window's gauges, verdicts and headroom.
        steps = StepAggregator(
            COST, "float32", PEAKS, window_seconds=10.0, clock=lambda: 1000.0
        )  # still: the gauges stay
        step_metrics = StepMetrics("tiny", steps)
        steps.add_sink(step_metrics)
        registry.register(step_metrics)
        steps.record(StepReport(scheduler=SchedulerState(0, 3, 1, 0.25)))
        steps.record(StepReport(step=StepRecord(0, 1, 200, 3, 3, 0.04)))
        steps.record(StepReport(step=StepRecord(0, 0, 0, 3, 3, 0.02)))
        odd = Gauge("odd_labels", 'values with "quotes", \\ and\nnewlines', ["value"], registry=registry)
        for value, figure in (
            ('say "hi"', 1.0),
            ("back\\slash", math.nan),
            ("line\nbreak", math.inf),
            ("é ✓", -math.inf),
        ):
            odd.labels(value).set(figure)
        small = Gauge("small_and_large", "values written in exponent form", ["k"], registry=registry)
        small.labels("small").set(1.25e-7)
        small.labels("large").set(123456789012.0)
        small.labels("negative zero").set(-0.0)
        small.labels("zero").set(0.0)
        latency = Histogram("latency_seconds", "with exemplars", ["model"], registry=registry)
        latency.labels("tiny").observe(0.2, {"trace_id": "abc"})
        latency.labels("other").observe(3.0)
        self.plain = Histogram("plain_seconds", "without", ["model"], buckets=(0.1, 1.0), registry=registry)
        self.plain.labels("tiny").observe(0.5)
        Counter("requests", "a counter", ["code"], registry=registry).labels("OK").inc(4)
        Summary("sizes", "a summary", registry=registry).observe(12)
        Info("build", "an info", registry=registry).info({"version": "1.2"})
        Enum("state", "an enum", states=["up", "down"], registry=registry).state("down")
        registry.register(Stamped())


@pytest.mark.parametrize("accept", ACCEPTS)
def test_a_scrape_is_byte_for_byte_what_the_library_writes_and_stays_so_as_values_move(accept: str) -> None:
    served = Served()
    encoder, _ = choose_encoder(accept)
    exposition = CachedExposition()
    assert exposition.encode(served.registry, encoder) == encoder(served.registry)
    # New values on kept lines, a new child and a new family.
    Gauge("late", "a family born after the first scrape", ["k"], registry=served.registry).labels("x").set(2)
    for round_ in range(2):
        served.observer.tokens_generated("tiny", 5)
        served.observer.tokens_generated(f"model-{round_}", 1)
        served.plain.labels("tiny").observe(0.05)
        assert exposition.encode(served.registry, encoder) == encoder(served.registry)


def _get(url: str, **headers: str) -> tuple[int, dict[str, str], bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, dict(exc.headers), exc.read()


def test_the_endpoint_answers_as_prometheus_client_does() -> None:
    served = Served()
    server, thread = start_metrics_server(0, "127.0.0.1", served.registry)
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        status, headers, body = _get(url)
        assert status == 200
        assert headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        assert body == generate_latest(served.registry)
        accept = "application/openmetrics-text;version=1.0.0"
        status, headers, body = _get(url, Accept=accept, **{"Accept-Encoding": "gzip"})
        assert headers["Content-Type"].startswith("application/openmetrics-text; version=1.0.0")
        assert headers["Content-Encoding"] == "gzip"
        assert gzip.decompress(body) == choose_encoder(accept)[0](served.registry)
        # A filtered scrape: only the families asked for.
        _, _, body = _get(url + "?name[]=requests_total")
        assert body.decode().splitlines() == [
            "# HELP requests_total a counter",
            "# TYPE requests_total counter",
            'requests_total{code="OK"} 4.0',
        ]
        request = urllib.request.Request(url, data=b"", method="POST")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=5)
        with refused.value:
            assert refused.value.code == 405
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
    assert not thread.is_alive()


def test_a_filtered_scrape_counts_the_held_step_reports() -> None:
    # Step reports wait in the telemetry pipeline; the collector that hands them on has no names, which the
    # library leaves out of a filtered scrape's: the step counter must still count every step.
    registry = CollectorRegistry()
    pipeline = TelemetryPipeline(batch=96)
    registry.register(pipeline.scrape_hook())
    aggregator = StepAggregator(COST, "float32", PEAKS, pipeline=pipeline)
    step_metrics = StepMetrics("tiny", aggregator)
    aggregator.add_sink(step_metrics)
    registry.register(step_metrics)
    for _ in range(5):
        aggregator.record(StepReport(step=StepRecord(0, 0, 0, 2, 2, 0.01)))
    server, _ = start_metrics_server(0, "127.0.0.1", registry)
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics?name[]=phasescope_engine_steps_total"
        _, _, body = _get(url)
        assert 'phasescope_engine_steps_total{engine="0",kind="decode",model="tiny"} 5.0' in body.decode()
    finally:
        server.shutdown()
        server.server_close()
