import pytest

from phasescope.bench.spread import combine_runs, most_frequent, spread


def test_spread_is_median_min_and_max() -> None:
    assert spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0}
    assert spread([4.0, 1.0]) == {"median": 2.5, "min": 1.0, "max": 4.0}


def test_combine_runs_reports_medians_under_the_runs_names_and_the_spread_of_every_figure() -> None:
    runs = [
        {"output_throughput": 100.0, "median_ttft_ms": 50.0, "completed": 8, "server_decode_verdict": "host"},
        {"output_throughput": 120.0, "median_ttft_ms": 70.0, "completed": 8, "server_decode_verdict": "memory"},
        {"output_throughput": 90.0, "median_ttft_ms": 55.0, "completed": 7, "server_decode_verdict": "memory"},
    ]
    point = combine_runs(runs)
    assert point["output_throughput"] == 100.0
    assert point["median_ttft_ms"] == 55.0
    assert point["completed"] == 8
    assert point["spread"]["output_throughput"] == {"median": 100.0, "min": 90.0, "max": 120.0}
    assert point["spread"]["completed"] == {"median": 8, "min": 7, "max": 8}
    assert point["server_decode_verdict"] == "memory"
    assert "server_decode_verdict" not in point["spread"]


def test_combine_runs_uses_the_runs_that_have_a_figure() -> None:
    point = combine_runs([{"goodput_ratio": 1.0, "server_kv_cache_usage_ratio": 0.2}, {"goodput_ratio": 0.5}])
    assert point["goodput_ratio"] == pytest.approx(0.75)
    assert point["spread"]["server_kv_cache_usage_ratio"] == {"median": 0.2, "min": 0.2, "max": 0.2}


def test_most_frequent_breaks_ties_toward_the_latest() -> None:
    assert most_frequent(["host", "memory", "memory"]) == "memory"
    assert most_frequent(["host", "memory"]) == "memory"
