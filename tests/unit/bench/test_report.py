from pathlib import Path
from typing import Any

from phasescope.bench.plots import plot
from phasescope.bench.report import figure, plan_lines, write_report

PNG = b"\x89PNG\r\n\x1a\n"


def point(value: float, goodput_ratio: float, mbu: float | None) -> dict[str, Any]:
    figures: dict[str, Any] = {
        "target": "phasescope", "load": "rate", "value": value, "repeats": 2,
        "request_throughput": value * 0.9, "output_throughput": 60.0 * value, "tokens_per_second_per_user": 15 / value,
        "median_ttft_ms": 100.0 * value, "p99_ttft_ms": 150.0 * value, "median_tpot_ms": 60.0 * value,
        "p99_tpot_ms": 80.0 * value, "median_e2el_ms": 4000.0, "errors": 0, "goodput_ratio": goodput_ratio,
        "request_goodput": value * goodput_ratio, "output_goodput": 60.0 * value * goodput_ratio,
        "saturation": {"over_saturated": value > 3, "runs_flagged": 2 if value > 3 else 0, "reasons": []},
    }  # fmt: skip
    if mbu is not None:
        figures.update({
            "server_device_bandwidth_saturation": mbu, "server_decode_bandwidth_saturation": mbu * 0.9,
            "server_device_compute_utilization": 0.01, "server_prefill_compute_utilization": 0.005,
            "server_device_compute_idleness": 0.99, "server_decode_verdict": "host", "server_prefill_verdict": "idle",
            "server_kv_cache_usage_ratio": 0.02 * value, "server_max_kv_cache_usage_ratio": 0.03 * value,
            "server_queue_wait_ratio": 0.0, "server_headroom_ratio": 0.5, "server_headroom_limit": "bandwidth",
            "server_mean_queue_ms": 1.0, "server_mean_prefill_ms": 50.0, "server_mean_decode_ms": 3000.0,
        })  # fmt: skip
    figures["spread"] = {
        "goodput_ratio": {"median": goodput_ratio, "min": goodput_ratio - 0.05, "max": goodput_ratio},
        "output_throughput": {"median": 60.0 * value, "min": 55.0 * value, "max": 62.0 * value},
    }
    return figures


def results(mbu: bool = True) -> dict[str, Any]:
    search = {"target": "phasescope", "mode": "search", "load": "rate", "goodput_target": 0.99,
              "bracket": [1.5, 2.0], "status": "bracketed", "converged": True, "points_run": 4,
              "goodput_ratio_at_answer": {"median": 1.0, "min": 0.94, "max": 1.0},
              "goodput_ratio_at_first_failing": {"median": 0.9, "min": 0.85, "max": 0.9}}  # fmt: skip
    loads = ((1.0, 1.0), (2.0, 0.9), (1.5, 1.0), (4.0, 0.2))
    return {
        "command": "phasescope bench --slo ttft_ms=2000,tpot_ms=150 --sla-search rate",
        "started": "2026-12-01T10:00:00+00:00",
        "parameters": {"repeats": 2, "requests": 16, "seed": 0},
        "settings": {"model": "m"},
        "machine": {"cpus": 2},
        "formulas": {"ttft": "TTFT = first streamed token − send"},
        "slo": {"ttft_ms": 2000.0, "tpot_ms": 150.0},
        "plans": [search],
        "points": [point(value, ratio, (0.1 * value) if mbu else None) for value, ratio in loads],
        "ratios": [],
    }


def test_the_search_sentence_gives_the_answer_its_bracket_and_its_spread() -> None:
    (line,) = plan_lines(results())
    assert "highest rate with goodput ratio ≥ 0.99 (ttft_ms ≤ 2000, tpot_ms ≤ 150): **1.5** requests/s" in line
    assert "bracket [1.5, 2]" in line
    assert "min–max 0.940–1.000 over 2 repeats" in line
    assert "at 2: 0.900 (0.850–0.900)" in line


def test_a_search_that_never_passed_says_the_limit_is_below_the_lowest_load() -> None:
    data = results()
    data["plans"][0].update(bracket=[None, 0.25], status="never_passed")
    (line,) = plan_lines(data)
    assert "none — even 0.25 requests/s failed" in line


def test_a_stopped_sweep_says_where_and_why() -> None:
    data = results()
    data["plans"] = [{"target": "phasescope", "mode": "sweep", "saturation_stop": {
        "load": "rate", "value": 4.0, "reasons": ["TTFT grows with time"], "skipped": [8.0, 16.0]}}]  # fmt: skip
    (line,) = plan_lines(data)
    assert "stopped at 4 requests/s, over-saturated — TTFT grows with time; rates not run: 8, 16" in line


def test_figures_show_the_spread_only_when_repeats_differ() -> None:
    p = point(2.0, 0.9, None)
    assert figure(p, "output_throughput") == "120.0 [110.0–124.0]"
    assert figure(p, "median_ttft_ms") == "200.0"
    assert figure(p, "goodput_ratio", 1, percent=True) == "90.0 [85.0–90.0] %"
    assert figure(p, "server_device_bandwidth_saturation") == "—"


def test_the_report_links_its_plots_and_holds_the_command_and_tables(tmp_path: Path) -> None:
    data = results()
    plots = plot(data, tmp_path)
    names = {p.name for p in plots}
    assert names == {"throughput.png", "latency.png", "pareto.png", "goodput.png", "hardware.png", "phases.png"}
    for path in plots:
        assert path.read_bytes()[:8] == PNG, path
    report = write_report(data, plots, tmp_path).read_text()
    assert data["command"] in report
    assert "![pareto](pareto.png)" in report
    # Points in order of load, though the search ran them out of order.
    assert report.index("| phasescope | rate 1 |") < report.index("| phasescope | rate 1.5 |")
    assert report.index("| phasescope | rate 1.5 |") < report.index("| phasescope | rate 2 |")
    assert "The hardware at each point" in report
    assert "yes (2/2)" in report


def test_plots_without_server_metrics_or_objectives_still_draw(tmp_path: Path) -> None:
    data = results(mbu=False)
    data["slo"] = {}
    data["plans"] = []
    names = {p.name for p in plot(data, tmp_path)}
    assert names == {"throughput.png", "latency.png", "pareto.png"}
