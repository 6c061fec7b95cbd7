import ctypes.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from phasescope.telemetry.hardware import probe
from phasescope.telemetry.hardware.probe import array_bytes_for, cached_measure, matmul_size_for, measure


def test_probe_returns_plausible_positive_numbers() -> None:
    result = measure("cpu", "float32", threads=1, array_mib=32)
    # Any machine that runs the tests moves more than 100 MB/s and does more than 100 MFLOP/s,
    # and none reaches 100 TB/s or 10 PFLOP/s on one CPU thread.
    bandwidths = (
        result.sum_bandwidth_bytes_per_second,
        result.gemv_bandwidth_bytes_per_second,
        result.triad_bandwidth_bytes_per_second,
    )
    for bandwidth in bandwidths:
        assert math.isfinite(bandwidth)
        assert 1e8 < bandwidth < 1e14
    # The peak is the faster read-only kernel's figure, never the triad's.
    assert result.memory_bandwidth_bytes_per_second == max(
        result.sum_bandwidth_bytes_per_second, result.gemv_bandwidth_bytes_per_second
    )
    assert 1e8 < result.matmul_flops_per_second < 1e16
    # The arrays are at least what was asked for, and twice the last-level cache (to a whole 64 KiB row).
    assert result.array_bytes >= 32 * 2**20
    assert result.array_bytes >= min(2 * probe.last_level_cache_bytes(), 2**30) - 64 * 2**10
    assert result.matmul_size == matmul_size_for("cpu", 1)
    peaks = result.peaks()
    assert peaks.source == "measured"
    assert peaks.memory_bandwidth_bytes_per_second == result.memory_bandwidth_bytes_per_second
    assert peaks.ridge_point_flops_per_byte("float32") > 0
    # Measured peaks are keyed by the family measured: no other dtype borrows the float32 matmul.
    assert set(peaks.flops_per_second) == {"fp32"}
    assert not peaks.has_flops("bfloat16")


def test_probe_runs_once_in_seconds_not_minutes_then_reads_its_cache(tmp_path: Path) -> None:
    first, first_cached = cached_measure(tmp_path, "cpu", "float32", threads=1)
    second, second_cached = cached_measure(tmp_path, "cpu", "float32", threads=1)
    assert (first_cached, second_cached) == (False, True)
    assert first.seconds_taken < 30
    assert second == first
    assert len(list((tmp_path / "hardware").glob("probe-*.json"))) == 1


def test_a_new_probe_version_does_not_reuse_an_old_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A cache written by probe version 1 (triad bandwidth) must not be read as this version's read bandwidth.
    old_identity = {**probe._identity("cpu", "float32", 1), "probe_version": 1}
    old_path = probe._cache_file(tmp_path, old_identity)
    assert old_path != probe._cache_file(tmp_path, probe._identity("cpu", "float32", 1))
    old_path.parent.mkdir(parents=True)
    old_path.write_text(json.dumps({"identity": old_identity, "result": {"memory_bandwidth_bytes_per_second": 1.0}}))
    result, cached = cached_measure(tmp_path, "cpu", "float32", threads=1)
    assert not cached
    assert result.memory_bandwidth_bytes_per_second > 1.0


def test_the_matmul_grows_with_the_threads_within_bounds() -> None:
    sizes = [matmul_size_for("cpu", threads) for threads in (1, 2, 8, 64, 1024)]
    assert sizes == sorted(sizes)
    assert sizes[0] == 1024
    # n³ ∝ threads: 8 threads get twice the side of one, so the same work each.
    assert sizes[2] == 2 * sizes[0]
    assert max(sizes) <= 6144
    assert all(size % 128 == 0 for size in sizes)
    assert matmul_size_for("cuda", 1) == 8192


def test_bandwidth_arrays_outgrow_the_cache_within_bounds() -> None:
    mib = 2**20
    assert array_bytes_for(0, 256) == 256 * mib
    assert array_bytes_for(32 * mib, 256) == 256 * mib
    assert array_bytes_for(384 * mib, 256) == 768 * mib
    assert array_bytes_for(4096 * mib, 256) == 1024 * mib
    assert array_bytes_for(4096 * mib, 2048) == 2048 * mib
    # Whole rows of the read GEMV (64 KiB each).
    assert array_bytes_for(1000 * 1024 + 7, 0) % (64 * 1024) == 0


def test_a_first_measure_leaves_its_arrays_out_of_the_callers_heap(tmp_path: Path) -> None:
    # `phasescope serve` runs on tcmalloc, which keeps what it freed: measured in the server itself, a first start's
    # gigabytes of arrays stayed in its heap (3.7 GB against 0.7 GB for a start that read the cache).
    library = ctypes.util.find_library("tcmalloc_minimal")
    assert library, "libtcmalloc-minimal4 is not installed: run make setup"
    script = (
        "import pathlib, sys, psutil, torch; from phasescope.telemetry.hardware.probe import cached_measure; "
        "before = psutil.Process().memory_info().rss; cached_measure(pathlib.Path(sys.argv[1]), threads=1); "
        "print(psutil.Process().memory_info().rss - before)"
    )
    grown = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        env={**os.environ, "LD_PRELOAD": library},
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert int(grown) < 128 * 2**20
