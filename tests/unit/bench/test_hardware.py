import pytest

from phasescope.bench.hardware import gauge_snapshot, gauge_view, server_view
from phasescope.telemetry.exposition import parse_samples


def exposition(decode_verdict: str, kv_usage: float, queue_wait: float, headroom: float, limit: str) -> str:
    lines = [f'phasescope_bound{{model="m",engine="0",phase="decode",verdict="{v}"}} {int(v == decode_verdict)}'
             for v in ("memory", "compute", "host", "queue", "idle")]  # fmt: skip
    lines += [
        'phasescope_bound{model="m",engine="0",phase="prefill",verdict="compute"} 1',
        'phasescope_host_overhead_ratio{model="m",engine="0",phase="decode"} 0.4',
        f'phasescope_headroom_ratio{{model="m",engine="0",limit="{limit}"}} {headroom}',
        f'phasescope_queue_wait_ratio{{model="m",engine="0"}} {queue_wait}',
        f'phasescope_kv_cache_usage_ratio{{model="m",engine="0"}} {kv_usage}',
        'phasescope_engine_requests{model="m",engine="0",state="running"} 6',
        'phasescope_engine_requests{model="m",engine="0",state="waiting"} 2',
    ]
    return "\n".join(lines) + "\n"


def test_a_snapshot_reads_the_verdicts_and_window_gauges() -> None:
    snapshot = gauge_snapshot(parse_samples(exposition("memory", 0.25, 0.1, 0.3, "bandwidth")))
    assert snapshot.verdicts == {"decode": ["memory"], "prefill": ["compute"]}
    assert snapshot.host_overhead_ratio == {"decode": pytest.approx(0.4)}
    assert snapshot.headroom_ratio == pytest.approx(0.3)
    assert snapshot.headroom_limit == "bandwidth"
    assert snapshot.kv_cache_usage_ratio == pytest.approx(0.25)
    assert snapshot.queue_wait_ratio == pytest.approx(0.1)
    assert (snapshot.running_requests, snapshot.waiting_requests) == (6, 2)


def test_a_runs_gauges_are_the_most_frequent_verdict_and_the_mean_and_extreme_of_each_ratio() -> None:
    snapshots = [
        gauge_snapshot(parse_samples(exposition("host", 0.1, 0.0, 0.5, "bandwidth"))),
        gauge_snapshot(parse_samples(exposition("memory", 0.3, 0.2, 0.2, "kv_cache"))),
        gauge_snapshot(parse_samples(exposition("memory", 0.5, 0.1, 0.2, "kv_cache"))),
    ]
    view = gauge_view(snapshots)
    assert view["server_gauge_samples"] == 3
    assert view["server_decode_verdict"] == "memory"
    assert view["server_prefill_verdict"] == "compute"
    assert view["server_kv_cache_usage_ratio"] == pytest.approx(0.3)
    assert view["server_max_kv_cache_usage_ratio"] == pytest.approx(0.5)
    assert view["server_queue_wait_ratio"] == pytest.approx(0.1)
    assert view["server_max_queue_wait_ratio"] == pytest.approx(0.2)
    assert view["server_headroom_ratio"] == pytest.approx(0.3)
    assert view["server_min_headroom_ratio"] == pytest.approx(0.2)
    assert view["server_headroom_limit"] == "kv_cache"
    assert view["server_decode_host_overhead_ratio"] == pytest.approx(0.4)
    assert view["server_max_waiting_requests"] == 2


def test_no_readings_give_no_gauge_figures() -> None:
    assert gauge_view([]) == {}


def test_server_view_divides_the_counters_deltas_by_the_peaks_over_the_run() -> None:
    def counters(read_bytes: float, flops: float, tokens: float) -> str:
        return "\n".join([
            'phasescope_engine_requests{model="m",engine="0",state="running"} 0',
            "phasescope_hardware_peak_memory_bandwidth_bytes_per_second 1e9",
            'phasescope_hardware_peak_flops_per_second{dtype="float32"} 1e12',
            f'phasescope_model_read_bytes_total{{model="m",phase="decode"}} {read_bytes}',
            f'phasescope_model_flops_total{{model="m",phase="decode"}} {flops}',
            f'phasescope_tokens_total{{model="m",phase="decode"}} {tokens}',
        ]) + "\n"  # fmt: skip

    view = server_view(parse_samples(counters(0, 0, 0)), parse_samples(counters(2e9, 1e11, 40)), duration=4.0)
    # 2 GB in 4 s against 1 GB/s; 1e11 FLOPs in 4 s against 1e12 FLOP/s.
    assert view["server_decode_bandwidth_saturation"] == pytest.approx(0.5)
    assert view["server_device_bandwidth_saturation"] == pytest.approx(0.5)
    assert view["server_device_compute_utilization"] == pytest.approx(0.025)
    assert view["server_device_compute_idleness"] == pytest.approx(0.975)
    assert view["server_decode_tokens_per_second"] == pytest.approx(10.0)


def test_server_view_reports_what_phasescopes_accounting_cost_the_engine_loop() -> None:
    def counters(hook_seconds: float, calls: int, busy_seconds: float) -> str:
        return "\n".join([
            f'phasescope_engine_telemetry_hook_seconds_total{{model="m",engine="0"}} {hook_seconds}',
            f'phasescope_engine_telemetry_hook_calls_total{{model="m",engine="0"}} {calls}',
            f'phasescope_engine_busy_seconds_total{{model="m",engine="0",phase="decode"}} {busy_seconds}',
        ]) + "\n"  # fmt: skip

    view = server_view(parse_samples(counters(0.001, 10, 1.0)), parse_samples(counters(0.004, 110, 3.0)), 4.0)
    # 3 ms over 100 steps; 3 ms of the steps' 2 s.
    assert view["server_engine_hook_us_per_step"] == pytest.approx(30.0)
    assert view["server_engine_hook_share_of_busy"] == pytest.approx(0.0015)
    assert server_view(parse_samples(""), parse_samples(""), 4.0)["server_engine_hook_us_per_step"] == 0.0
