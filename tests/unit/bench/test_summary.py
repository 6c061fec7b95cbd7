import pytest

from phasescope.bench.summary import ratios, summarize
from phasescope.bench.workload import RequestRecord


def record(index: int, sent: float, token_times: list[float], error: str = "") -> RequestRecord:
    return RequestRecord(index, sent, token_times, len(token_times), prompt_tokens=10, error=error)


def test_summary_follows_the_bench_serve_definitions() -> None:
    records = [
        record(0, 0.0, [0.1, 0.3, 0.5]),  # TTFT 100 ms, TPOT (500 − 100) ÷ 2 = 200 ms
        record(1, 1.0, [1.3, 1.4]),  # TTFT 300 ms, TPOT 100 ms
        record(2, 2.0, [], error="DEADLINE_EXCEEDED"),
    ]
    summary = summarize(records, duration=2.0)
    assert (summary["completed"], summary["errors"], summary["timeouts"]) == (2, 1, 1)
    assert summary["total_output_tokens"] == 5
    assert summary["output_throughput"] == pytest.approx(2.5)
    assert summary["total_token_throughput"] == pytest.approx((5 + 20) / 2.0)
    assert summary["mean_ttft_ms"] == pytest.approx(200.0)
    assert summary["max_tpot_ms"] == pytest.approx(200.0)
    # ITL pools every gap: 200, 200 and 100 ms.
    assert summary["median_itl_ms"] == pytest.approx(200.0)
    assert summary["max_e2el_ms"] == pytest.approx(500.0)


def test_percentiles_interpolate_between_ranks_as_numpy_and_bench_serve_do() -> None:
    # TTFTs 100, 200, 300 and 400 ms. np.percentile's linear interpolation: p90 sits 0.9 × 3 = 2.7 ranks
    # in, 70 % of the way from 300 to 400 ms. Nearest rank (and the rounded index used before) says 400.
    records = [record(i, float(i), [i + 0.1 * (i + 1)]) for i in range(4)]
    summary = summarize(records, duration=4.0)
    assert summary["median_ttft_ms"] == pytest.approx(250.0)
    assert summary["p90_ttft_ms"] == pytest.approx(370.0)
    assert summary["p95_ttft_ms"] == pytest.approx(385.0)
    assert summary["p99_ttft_ms"] == pytest.approx(397.0)
    assert summary["max_ttft_ms"] == pytest.approx(400.0)


def test_a_point_without_completions_reports_zero_latencies() -> None:
    summary = summarize([record(0, 0.0, [], error="UNAVAILABLE")], duration=1.0)
    assert summary["completed"] == 0
    assert summary["p99_ttft_ms"] == 0.0


def test_ratios_set_phasescope_beside_the_other_targets_at_the_same_point() -> None:
    point = {"load": "concurrency", "value": 4.0}
    results = [
        {**point, "target": "phasescope", "output_throughput": 90.0, "median_ttft_ms": 30.0,
         "frontend_cpu_seconds_per_1k_tokens": 0.08},
        {**point, "target": "in-process", "output_throughput": 100.0, "median_ttft_ms": 20.0},
        {**point, "target": "vllm-openai", "output_throughput": 95.0, "median_ttft_ms": 25.0,
         "frontend_cpu_seconds_per_1k_tokens": 0.06},
    ]  # fmt: skip
    (row,) = ratios(results)
    assert row["throughput_vs_in-process"] == pytest.approx(0.9)
    assert row["median_ttft_ms_minus_vllm-openai"] == pytest.approx(5.0)
    assert row["frontend_cpu_vs_vllm-openai"] == pytest.approx(0.08 / 0.06)


def test_phasescope_over_the_engine_protocol_is_set_beside_vllms_own_grpc_worker() -> None:
    point = {"load": "concurrency", "value": 64.0}
    results = [
        {**point, "target": "phasescope-vllm-grpc", "output_throughput": 2100.0, "median_ttft_ms": 210.0,
         "frontend_cpu_seconds_per_1k_tokens": 0.07},
        {**point, "target": "vllm-grpc", "output_throughput": 2000.0, "median_ttft_ms": 200.0,
         "frontend_cpu_seconds_per_1k_tokens": 0.08},
    ]  # fmt: skip
    (row,) = ratios(results)
    assert row["target"] == "phasescope-vllm-grpc"
    assert row["throughput_vs_vllm-grpc"] == pytest.approx(1.05)
    assert row["median_ttft_vs_vllm-grpc"] == pytest.approx(1.05)
    assert row["frontend_cpu_vs_vllm-grpc"] == pytest.approx(0.875)
    assert "throughput_vs_in-process" not in row
