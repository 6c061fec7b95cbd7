import dataclasses
from collections.abc import Callable

import pytest
from prometheus_client import CollectorRegistry

from phasescope.telemetry.errors import TelemetryErrors
from phasescope.telemetry.request.observer import ObserverGroup
from phasescope.telemetry.request.phases import (
    EngineTimestamps,
    FirstTokenRecord,
    FrontendTimestamps,
    PhaseRecord,
    PhaseTimings,
    SampleRecord,
    derive_phase_timings,
)
from phasescope.telemetry.request.prometheus import PrometheusRequestObserver

MODEL = "tiny"


# The request series carry the adapter label; a request on the base model has "base".
ADAPTER_SERIES = (
    "phasescope_requests_total", "phasescope_time_to_first_token_seconds", "phasescope_requests_in_flight",
    "phasescope_tokens_total", "phasescope_requests_rejected_total", "phasescope_request_phase_seconds",
    "phasescope_request_duration_seconds", "phasescope_requests_without_first_token_total",
)  # fmt: skip


def labelled(name: str, labels: dict[str, str]) -> dict[str, str]:
    adapter = {"adapter": "base"} if name.startswith(ADAPTER_SERIES) else {}
    return {"model": MODEL, **adapter, **labels}


FRONT = FrontendTimestamps(entry=9.98, wall_at_entry=1.7e9, handed_to_engine=9.99, ended=11.83)
TIMINGS = PhaseTimings(
    frontend_seconds=0.02,
    queue_seconds=0.01,
    prefill_seconds=0.3,
    decode_seconds=1.5,
    time_to_first_token_seconds=0.33,
    e2e_seconds=1.83,
    mean_inter_token_seconds=0.75,
    decode_tokens_per_second=1.333,
    client_time_to_first_token_seconds=0.335,
)


def record(**overrides: object) -> PhaseRecord:
    values: dict[str, object] = {
        "model": MODEL,
        "code": "OK",
        "finish_reason": "stop",
        "prompt_tokens": 12,
        "cached_prompt_tokens": 4,
        "completion_tokens": 3,
        "timings": TIMINGS,
        "front": FRONT,
        "stamps": EngineTimestamps(10.0, 10.01, 10.31, 11.81),
    }
    values.update(overrides)
    return PhaseRecord(**values)  # type: ignore[arg-type]


def first_token(streaming: bool = True) -> FirstTokenRecord:
    return FirstTokenRecord(MODEL, TIMINGS, prefill_tokens_computed=8, streaming=streaming)


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


def test_figures_are_recorded_when_they_become_known(registry: CollectorRegistry) -> None:
    observer = PrometheusRequestObserver()
    registry.register(observer)

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labelled(name, labels))

    observer.request_started(MODEL)
    assert value("phasescope_requests_in_flight") == 1
    # At the first token: the stages before it, TTFT and the prompt's computed tokens.
    observer.tokens_generated(MODEL, 1)
    observer.request_first_token(first_token())
    assert value("phasescope_tokens_total", phase="prefill") == 8
    assert value("phasescope_tokens_total", phase="decode") == 1
    assert value("phasescope_request_phase_seconds_sum", phase="frontend") == pytest.approx(0.02)
    assert value("phasescope_request_phase_seconds_sum", phase="queue") == pytest.approx(0.01)
    assert value("phasescope_request_phase_seconds_sum", phase="prefill") == pytest.approx(0.3)
    assert value("phasescope_time_to_first_token_seconds_sum") == pytest.approx(0.33)
    assert value("phasescope_client_time_to_first_token_seconds_sum") == pytest.approx(0.335)
    assert value("phasescope_request_phase_seconds_count", phase="decode") is None
    # Tokens as they stream, not when the request ends.
    observer.tokens_generated(MODEL, 2)
    assert value("phasescope_tokens_total", phase="decode") == 3
    # At the end: decode and E2E, once; the first token's stages are not observed again.
    observer.request_finished(record())
    assert value("phasescope_requests_in_flight") == 0
    assert value("phasescope_requests_total", code="OK", finish_reason="stop") == 1
    assert value("phasescope_request_phase_seconds_count", phase="queue") == 1
    assert value("phasescope_request_phase_seconds_sum", phase="decode") == pytest.approx(1.5)
    assert value("phasescope_request_phase_seconds_bucket", phase="decode", le="1.0") == 0
    assert value("phasescope_request_phase_seconds_bucket", phase="decode", le="1.5") == 1
    assert value("phasescope_request_duration_seconds_sum") == pytest.approx(1.83)
    assert value("phasescope_time_to_first_token_seconds_count") == 1
    assert value("phasescope_requests_without_first_token_total", code="OK") is None


def test_unary_requests_stay_out_of_the_client_ttft_histogram(registry: CollectorRegistry) -> None:
    # A unary caller sees its first token with the whole answer: that is its E2E, not a TTFT.
    observer = PrometheusRequestObserver()
    registry.register(observer)
    observer.request_first_token(first_token(streaming=False))
    assert (
        registry.get_sample_value("phasescope_time_to_first_token_seconds_count", {"model": MODEL, "adapter": "base"})
        == 1
    )
    assert registry.get_sample_value("phasescope_client_time_to_first_token_seconds_count", {"model": MODEL}) is None


def test_request_ended_before_its_first_token_counts_against_the_ttft_slo(registry: CollectorRegistry) -> None:
    observer = PrometheusRequestObserver()
    registry.register(observer)
    observer.request_started(MODEL)
    front = FrontendTimestamps(9.9, 1.7e9, handed_to_engine=9.95, ended=11.2)
    observer.request_finished(
        record(
            code="DEADLINE_EXCEEDED",
            finish_reason="error",
            completion_tokens=0,
            stamps=None,
            front=front,
            timings=derive_phase_timings(front, None, 0),
        )
    )

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labelled(name, labels))

    assert value("phasescope_requests_without_first_token_total", code="DEADLINE_EXCEEDED") == 1
    assert value("phasescope_request_phase_seconds_sum", phase="frontend") == pytest.approx(0.05)
    assert value("phasescope_request_phase_seconds_sum", phase="abandoned") == pytest.approx(1.25)
    # No token came, so nothing was computed for it as far as the counters know.
    assert value("phasescope_tokens_total", phase="prefill") is None
    assert value("phasescope_time_to_first_token_seconds_count") is None
    assert value("phasescope_request_phase_seconds_count", phase="decode") is None
    assert value("phasescope_requests_total", code="DEADLINE_EXCEEDED", finish_reason="error") == 1


def test_a_structured_output_requests_queue_is_observed_by_its_kind(registry: CollectorRegistry) -> None:
    observer = PrometheusRequestObserver()
    registry.register(observer)
    observer.request_first_token(FirstTokenRecord(MODEL, TIMINGS, 8, streaming=True, constraint="json_schema"))
    observer.request_first_token(first_token())  # a plain request is not in it
    series = "phasescope_structured_output_queue_seconds"
    labels = {"model": MODEL, "constraint": "json_schema"}
    assert registry.get_sample_value(f"{series}_count", labels) == 1
    assert registry.get_sample_value(f"{series}_sum", labels) == pytest.approx(TIMINGS.queue_seconds)
    assert registry.get_sample_value(f"{series}_count", {"model": MODEL, "constraint": "regex"}) is None


def test_a_request_with_samples_observes_its_shared_stages_once_and_each_sequence_on_its_own(
    registry: CollectorRegistry,
) -> None:
    observer = PrometheusRequestObserver()
    registry.register(observer)

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labelled(name, labels))

    observer.request_started(MODEL)
    for sample in range(3):
        observer.request_first_token(
            FirstTokenRecord(MODEL, TIMINGS, 8, streaming=True, sample=sample, request_first=sample == 0)
        )
    samples = tuple(
        SampleRecord(index, "stop", 3, 4, TIMINGS, EngineTimestamps(10.0, 10.01, 10.31, 11.81)) for index in range(3)
    )
    observer.request_finished(record(samples=samples, completion_tokens=9))
    assert value("phasescope_requests_total", code="OK", finish_reason="stop") == 1
    assert value("phasescope_request_phase_seconds_count", phase="frontend") == 1
    assert value("phasescope_client_time_to_first_token_seconds_count") == 1
    for phase in ("queue", "prefill", "decode"):
        assert value("phasescope_request_phase_seconds_count", phase=phase) == 3, phase
    assert value("phasescope_time_to_first_token_seconds_count") == 3
    assert value("phasescope_request_duration_seconds_count") == 3
    assert value("phasescope_tokens_total", phase="prefill") == 24


def test_rejections_are_counted_by_reason(registry: CollectorRegistry) -> None:
    observer = PrometheusRequestObserver()
    registry.register(observer)
    observer.request_rejected(MODEL, "overloaded")
    observer.request_rejected(MODEL, "overloaded")
    observer.request_rejected(MODEL, "invalid_argument")
    sample = registry.get_sample_value
    assert (
        sample("phasescope_requests_rejected_total", {"model": MODEL, "adapter": "base", "reason": "overloaded"}) == 2
    )
    assert (
        sample("phasescope_requests_rejected_total", {"model": MODEL, "adapter": "base", "reason": "invalid_argument"})
        == 1
    )


def test_no_metric_name_contains_vllm(registry: CollectorRegistry) -> None:
    # vLLM's unregister_vllm_metrics() drops every collector whose name contains "vllm".
    registry.register(PrometheusRequestObserver())
    names = {metric.name for metric in registry.collect()}
    assert names
    assert all(name.startswith("phasescope_") and "vllm" not in name for name in names)


def test_a_failing_observer_does_not_stop_the_others_and_is_counted(registry: CollectorRegistry) -> None:
    class Broken:
        def __getattr__(self, name: str) -> Callable[..., None]:
            def fail(*args: object) -> None:
                raise RuntimeError("broken")

            return fail

    errors = TelemetryErrors(MODEL)
    registry.register(errors)
    request_metrics = PrometheusRequestObserver()
    registry.register(request_metrics)
    group = ObserverGroup([Broken(), request_metrics], on_error=errors)
    group.request_started(MODEL)
    group.request_first_token(first_token())
    group.tokens_generated(MODEL, 3)
    group.request_finished(record())
    group.request_rejected(MODEL, "overloaded")
    sample = registry.get_sample_value
    assert (
        sample("phasescope_requests_total", {"model": MODEL, "adapter": "base", "code": "OK", "finish_reason": "stop"})
        == 1
    )
    assert sample("phasescope_tokens_total", {"model": MODEL, "adapter": "base", "phase": "decode"}) == 3
    assert sample("phasescope_telemetry_errors_total", {"model": MODEL, "component": "observer"}) == 5


def test_token_counts_scrape_as_a_counter_that_a_scrape_mid_stream_sees_grow(registry: CollectorRegistry) -> None:
    from prometheus_client import generate_latest

    observer = PrometheusRequestObserver()
    registry.register(observer)
    observer.request_first_token(first_token())
    observer.tokens_generated(MODEL, 2)
    first = generate_latest(registry).decode()
    assert "# TYPE phasescope_tokens_total counter" in first
    assert f'phasescope_tokens_total{{adapter="base",model="{MODEL}",phase="decode"}} 2.0' in first
    observer.tokens_generated(MODEL, 5)
    observer.tokens_generated("other", 1)
    assert (
        registry.get_sample_value("phasescope_tokens_total", {"model": MODEL, "adapter": "base", "phase": "decode"})
        == 7
    )
    assert (
        registry.get_sample_value("phasescope_tokens_total", {"model": "other", "adapter": "base", "phase": "decode"})
        == 1
    )
    assert (
        registry.get_sample_value("phasescope_tokens_total", {"model": MODEL, "adapter": "base", "phase": "prefill"})
        == 8
    )


def test_a_kv_transfer_is_observed_as_its_stage_with_the_tokens_and_bytes_moved(registry: CollectorRegistry) -> None:
    observer = PrometheusRequestObserver()
    registry.register(observer)
    decode_worker = dataclasses.replace(TIMINGS, kv_transfer_seconds=0.04, kv_loaded_tokens=768, kv_transfer_bytes=7e6)
    prefill_worker = dataclasses.replace(TIMINGS, kv_transfer_seconds=0.02, kv_saved_tokens=857, kv_transfer_bytes=8e6)
    for timings in (decode_worker, prefill_worker, TIMINGS):
        observer.request_started(MODEL)
        observer.request_finished(record(timings=timings))

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labelled(name, labels))

    assert value("phasescope_request_phase_seconds_count", phase="kv_transfer") == 2  # not the third: none moved
    assert value("phasescope_request_phase_seconds_sum", phase="kv_transfer") == pytest.approx(0.06)
    assert value("phasescope_kv_transfer_tokens_total", direction="loaded") == 768
    assert value("phasescope_kv_transfer_tokens_total", direction="saved") == 857
    assert value("phasescope_kv_transfer_bytes_total") == 15e6
