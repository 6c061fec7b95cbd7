from pathlib import Path

from telemetry.probe import cached_measure, measure


def test_probe_returns_plausible_positive_numbers() -> None:
    result = measure("cpu", "float32", threads=1, array_mib=32)
    # Any machine that runs the tests moves more than 100 MB/s and does more than 100 MFLOP/s,
    # and none reaches 100 TB/s or 10 PFLOP/s on one CPU thread.
    assert 1e8 < result.memory_bandwidth_bytes_per_second < 1e14
    assert 1e8 < result.matmul_flops_per_second < 1e16
    peaks = result.peaks()
    assert peaks.source == "measured"
    assert peaks.ridge_point_flops_per_byte("float32") > 0


def test_probe_runs_once_then_reads_its_cache(tmp_path: Path) -> None:
    first, first_cached = cached_measure(tmp_path, "cpu", "float32", threads=1)
    second, second_cached = cached_measure(tmp_path, "cpu", "float32", threads=1)
    assert (first_cached, second_cached) == (False, True)
    assert second == first
    assert len(list((tmp_path / "hardware").glob("probe-*.json"))) == 1
