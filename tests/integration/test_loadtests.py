"""The locust user and the benchmark harness against the real server: short, bounded runs."""

from __future__ import annotations

import csv
import gzip
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from phasescope.telemetry.step.verdict import VERDICTS
from support.servers import ServerProcess

ROOT = Path(__file__).resolve().parents[2]
LOCUST = Path(sys.executable).parent / "locust"


def run_locust(server: ServerProcess, prefix: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            str(LOCUST), "-f", "loadtests/locustfile.py", "--headless", "--only-summary",
            "-u", "3", "-r", "3", "-t", "5s", "--stop-timeout", "30", "--host", server.address,
            "--max-tokens", "12", "--ignore-eos", "--csv", str(prefix), *extra,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )  # fmt: skip


def test_headless_locust_run_streams_without_failures(server: ServerProcess, tmp_path: Path) -> None:
    result = run_locust(server, tmp_path / "run")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with (tmp_path / "run_stats.csv").open() as handle:
        rows = {row["Name"]: row for row in csv.DictReader(handle)}
    for name in ("TTFT (ms)", "TPOT (µs)", "E2E (ms)"):
        assert int(rows[name]["Request Count"]) > 0, name
        assert int(rows[name]["Failure Count"]) == 0, name
    # Every request's 12 tokens are its response length.
    assert float(rows["E2E (ms)"]["Average Content Size"]) == 12
    # TPOT is in microseconds: a CPU decode step takes milliseconds, so it reads in the thousands.
    assert float(rows["TPOT (µs)"]["Median Response Time"]) > 1000


def test_quitting_gate_fails_the_run_when_p95_ttft_exceeds_its_bound(server: ServerProcess, tmp_path: Path) -> None:
    result = run_locust(server, tmp_path / "gated", "--max-p95-ttft-ms", "0.001")
    assert result.returncode == 1
    assert "phasescope gate failed: p95 TTFT (ms)" in result.stdout + result.stderr


def test_bench_tiny_sweep_writes_results_and_plots(server: ServerProcess, tmp_path: Path) -> None:
    out = tmp_path / "bench"
    result = subprocess.run(
        [
            sys.executable, "-m", "phasescope", "bench", "--address", server.address,
            "--metrics-url", f"http://127.0.0.1:{server.metrics_port}/metrics",
            "--concurrency", "2", "--rates", "4", "--requests", "3", "--warmup", "1", "--max-tokens", "8",
            "--output-dir", str(out),
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(gzip.decompress((out / "bench.json.gz").read_bytes()))
    # A closed-loop point and a Poisson-arrival point.
    assert [(p["load"], p["value"]) for p in report["points"]] == [("concurrency", 2.0), ("rate", 4.0)]
    for point in report["points"]:
        # vLLM bench-serve field names, and the raw per-request records.
        for key in ("request_throughput", "output_throughput", "total_token_throughput", "median_ttft_ms",
                    "p99_tpot_ms", "p90_itl_ms", "max_e2el_ms", "mean_tpot_ms", "std_ttft_ms"):  # fmt: skip
            assert point[key] >= 0, key
        assert point["completed"] == 3
        assert point["errors"] == 0
        assert point["total_output_tokens"] == 24
        assert len(point["runs"][0]["records"]) == 3
        # The server's own view of the same window.
        assert point["server_decode_tokens_per_second"] > 0
        assert 0 < point["server_device_compute_idleness"] <= 1
        assert 0 < point["server_decode_bandwidth_saturation"] <= point["server_device_bandwidth_saturation"]
    assert set(report["formulas"]) >= {"ttft", "tpot", "itl", "e2el"}
    for name in ("throughput.png", "pareto.png", "latency.png", "phases.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


def test_bench_sweep_with_an_slo_and_repeats_reports_goodput_spread_and_the_hardware(
    server: ServerProcess, tmp_path: Path
) -> None:
    out = tmp_path / "bench"
    command = [
        sys.executable, "-m", "phasescope", "bench", "--address", server.address,
        "--metrics-url", f"http://127.0.0.1:{server.metrics_port}/metrics",
        "--concurrency", "1", "--rates", "4", "--requests", "3", "--warmup", "1", "--max-tokens", "8",
        "--repeats", "2", "--slo", "ttft_ms=60000,tpot_ms=60000", "--output-dir", str(out),
    ]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(gzip.decompress((out / "bench.json.gz").read_bytes()))
    # The exact command and every parameter, to rerun it.
    assert report["command"] == shlex.join(["phasescope", *command[3:]])
    assert report["parameters"]["repeats"] == 2
    assert report["parameters"]["slo"] == {"ttft_ms": 60000.0, "tpot_ms": 60000.0}
    assert [(p["load"], p["value"], p["repeats"]) for p in report["points"]] == [
        ("concurrency", 1.0, 2),
        ("rate", 4.0, 2),
    ]
    for point in report["points"]:
        # Goodput: every request meets objectives this loose.
        assert point["goodput_ratio"] == 1.0
        assert point["request_goodput"] == point["request_throughput"] > 0
        assert point["output_goodput"] == point["output_throughput"] > 0
        # Two runs with their own seeds; the point is their median, with min and max.
        seeds = [run["seed"] for run in point["runs"]]
        assert len(set(seeds)) == 2
        throughputs = [run["output_throughput"] for run in point["runs"]]
        assert point["spread"]["output_throughput"] == {
            "median": sum(throughputs) / 2, "min": min(throughputs), "max": max(throughputs)}  # fmt: skip
        assert set(point["spread"]["goodput_ratio"]) == {"median", "min", "max"}
        for run in point["runs"]:
            assert len(run["records"]) == 3
            assert all(record["met_slo"] for record in run["records"])
            assert "over_saturated" in run["saturation"]
        # The hardware at the point, from the server's /metrics.
        assert 0 < point["server_device_bandwidth_saturation"] <= 1
        assert 0 < point["server_device_compute_utilization"] < 1
        assert 0 < point["server_device_compute_idleness"] <= 1
        assert point["server_decode_verdict"] in VERDICTS
        assert point["server_prefill_verdict"] in VERDICTS
        assert point["server_gauge_samples"] >= 1
        assert 0 <= point["server_kv_cache_usage_ratio"] <= point["server_max_kv_cache_usage_ratio"] <= 1
        assert 0 <= point["server_queue_wait_ratio"] <= 1
        assert 0 <= point["server_headroom_ratio"] <= 1
        assert point["server_headroom_limit"] in ("bandwidth", "compute", "kv_cache", "queue")
        assert set(point["spread"]["server_device_bandwidth_saturation"]) == {"median", "min", "max"}
    assert report["plans"] == [{"target": "phasescope", "mode": "sweep", "saturation_stop": None}]
    markdown = (out / "report.md").read_text()
    assert report["command"] in markdown
    assert "The hardware at each point" in markdown
    for name in ("throughput.png", "pareto.png", "latency.png", "goodput.png", "hardware.png", "phases.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


def test_bench_tiny_model_starts_its_own_server_and_takes_bursts(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    command = [
        sys.executable, "-m", "phasescope", "bench", "--tiny-model", "--concurrency", "4", "--bursts", "8",
        "--requests", "16", "--warmup", "2", "--max-tokens", "16", "--max-num-seqs", "16", "--max-model-len", "512",
        "--kv-cache-gib", "0.25", "--token-ids-only", "--no-token-times", "--pin-cpus", "--output-dir", str(out),
    ]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=420, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(gzip.decompress((out / "bench.json.gz").read_bytes()))
    assert report["parameters"]["pin_cpus"] is True
    if len(os.sched_getaffinity(0)) > 1:
        # vLLM bound the worker to part of the CPUs; the client and the server it started took the rest.
        assert "the engines' workers alone on" in result.stderr, result.stderr[-3000:]
    # The server it started served the tiny model, built (or reused) in the cache.
    assert report["settings"]["served_name"] == "tiny-llama-random"
    assert report["parameters"]["token_ids_only"] is True
    assert [(p["load"], p["value"]) for p in report["points"]] == [("concurrency", 4.0), ("burst", 8.0)]
    for point in report["points"]:
        assert (point["completed"], point["errors"], point["total_output_tokens"]) == (16, 0, 256)
        assert point["frontend_cpu_seconds_per_1k_tokens"] > 0
    # Two waves of eight: each wave's requests are all sent before any of them ends.
    records = sorted(report["points"][1]["runs"][0]["records"], key=lambda r: r["sent"])
    first, second = records[:8], records[8:]
    assert max(r["sent"] for r in first) < min(r["finished"] for r in first)
    assert min(r["sent"] for r in second) >= max(r["finished"] for r in first)


def test_a_terminated_bench_stops_the_server_and_engine_it_started(tmp_path: Path) -> None:
    # Killed by a CI timeout, `timeout` or systemd, the bench must not leave a server and its engine
    # spinning on the machine's cores.
    out, log = tmp_path / "bench", tmp_path / "bench.log"
    command = [
        sys.executable, "-m", "phasescope", "bench", "--tiny-model", "--concurrency", "2", "--requests", "5000",
        "--warmup", "0", "--max-tokens", "64", "--max-num-seqs", "4", "--max-model-len", "512",
        "--kv-cache-gib", "0.25", "--no-token-times", "--output-dir", str(out),
    ]  # fmt: skip
    with log.open("w") as stderr:
        bench = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        deadline = time.monotonic() + 300
        while "phasescope concurrency=2 #1" not in log.read_text(errors="replace"):
            assert bench.poll() is None, log.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "the bench never started measuring"
            time.sleep(1)
        started = psutil.Process(bench.pid).children(recursive=True)
        assert any(p.name() == "VLLM::EngineCore" for p in started), [p.name() for p in started]
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=180) == 130, log.read_text(errors="replace")[-3000:]
    finally:
        if bench.poll() is None:
            bench.kill()
    _, alive = psutil.wait_procs(started, timeout=60)
    assert not alive, [(p.pid, p.name()) for p in alive]
    assert "interrupted; the servers and engines it started are stopped" in log.read_text(errors="replace")
    assert not (out / "bench.json.gz").exists()
