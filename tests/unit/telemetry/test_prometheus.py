import pytest
from prometheus_client import CollectorRegistry

from telemetry.observer import ObserverGroup
from telemetry.phases import PhaseRecord, PhaseTimings
from telemetry.prometheus import PrometheusRequestObserver

MODEL = "tiny"


def record(**overrides: object) -> PhaseRecord:
    values: dict[str, object] = {
        "model": MODEL,
        "code": "OK",
        "finish_reason": "stop",
        "prompt_tokens": 12,
        "cached_prompt_tokens": 4,
        "completion_tokens": 3,
        "timings": PhaseTimings(0.02, 0.3, 1.5, 0.33, 1.83, 0.75, 1.333),
        "inter_token_seconds": (0.5, 1.0),
    }
    values.update(overrides)
    return PhaseRecord(**values)  # type: ignore[arg-type]


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


def test_finished_request_is_recorded_in_every_series(registry: CollectorRegistry) -> None:
    observer = PrometheusRequestObserver(registry)
    observer.request_started(MODEL)
    assert registry.get_sample_value("phasescope_requests_in_flight", {"model": MODEL}) == 1
    observer.request_finished(record())

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"model": MODEL, **labels})

    assert value("phasescope_requests_in_flight") == 0
    assert value("phasescope_requests_total", code="OK", finish_reason="stop") == 1
    assert value("phasescope_tokens_total", phase="prefill") == 8
    assert value("phasescope_tokens_total", phase="decode") == 3
    assert value("phasescope_request_phase_seconds_count", phase="queue") == 1
    assert value("phasescope_request_phase_seconds_sum", phase="queue") == pytest.approx(0.02)
    assert value("phasescope_request_phase_seconds_sum", phase="prefill") == pytest.approx(0.3)
    assert value("phasescope_request_phase_seconds_sum", phase="decode") == pytest.approx(1.5)
    assert value("phasescope_request_phase_seconds_bucket", phase="decode", le="1.0") == 0
    assert value("phasescope_request_phase_seconds_bucket", phase="decode", le="1.5") == 1
    assert value("phasescope_time_to_first_token_seconds_sum") == pytest.approx(0.33)
    assert value("phasescope_request_duration_seconds_sum") == pytest.approx(1.83)
    assert value("phasescope_inter_token_latency_seconds_count") == 2
    assert value("phasescope_inter_token_latency_seconds_sum") == pytest.approx(1.5)


def test_phase_never_reached_is_not_observed(registry: CollectorRegistry) -> None:
    observer = PrometheusRequestObserver(registry)
    observer.request_started(MODEL)
    observer.request_finished(
        record(
            code="CANCELLED",
            finish_reason="abort",
            completion_tokens=0,
            timings=PhaseTimings(0.1, None, None, None, None, None, None),
            inter_token_seconds=(),
        )
    )
    assert registry.get_sample_value("phasescope_request_phase_seconds_count", {"model": MODEL, "phase": "queue"}) == 1
    assert (
        registry.get_sample_value("phasescope_request_phase_seconds_count", {"model": MODEL, "phase": "decode"}) is None
    )
    assert (
        registry.get_sample_value(
            "phasescope_requests_total", {"model": MODEL, "code": "CANCELLED", "finish_reason": "abort"}
        )
        == 1
    )


def test_rejections_are_counted_by_reason(registry: CollectorRegistry) -> None:
    observer = PrometheusRequestObserver(registry)
    observer.request_rejected(MODEL, "overloaded")
    observer.request_rejected(MODEL, "overloaded")
    observer.request_rejected(MODEL, "invalid_argument")
    sample = registry.get_sample_value
    assert sample("phasescope_requests_rejected_total", {"model": MODEL, "reason": "overloaded"}) == 2
    assert sample("phasescope_requests_rejected_total", {"model": MODEL, "reason": "invalid_argument"}) == 1


def test_no_metric_name_contains_vllm(registry: CollectorRegistry) -> None:
    # vLLM's unregister_vllm_metrics() drops every collector whose name contains "vllm".
    PrometheusRequestObserver(registry)
    names = {metric.name for metric in registry.collect()}
    assert names
    assert all(name.startswith("phasescope_") and "vllm" not in name for name in names)


def test_a_failing_observer_does_not_stop_the_others(registry: CollectorRegistry) -> None:
    class Broken:
        def request_started(self, model: str) -> None:
            raise RuntimeError("broken")

        def request_finished(self, record: PhaseRecord) -> None:
            raise RuntimeError("broken")

        def request_rejected(self, model: str, reason: str) -> None:
            raise RuntimeError("broken")

    group = ObserverGroup([Broken(), PrometheusRequestObserver(registry)])
    group.request_started(MODEL)
    group.request_finished(record())
    group.request_rejected(MODEL, "overloaded")
    assert (
        registry.get_sample_value("phasescope_requests_total", {"model": MODEL, "code": "OK", "finish_reason": "stop"})
        == 1
    )
