"""What a bench run writes: its raw results gzipped, from the typed configuration (the targets faked)."""

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from phasescope.bench import runner
from phasescope.bench.config import BenchConfig
from phasescope.cli.main import build_parser


def test_the_raw_results_are_written_as_gzipped_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[BenchConfig] = []

    async def measured(config: BenchConfig) -> dict[str, Any]:
        seen.append(config)
        return {"started": "2026-12-01T00:00:00+00:00", "command": config.command, "slo": {},
                "parameters": config.parameters(), "settings": None, "machine": runner.machine(),
                "formulas": {}, "plans": [], "points": [], "ratios": []}  # fmt: skip

    monkeypatch.setattr(runner, "run", measured)
    monkeypatch.setattr(runner, "stop_on_sigterm", lambda: None)  # pytest's own SIGTERM handling stays
    monkeypatch.setattr(runner, "plot", lambda results, out: [])  # a run without points has nothing to chart
    argv = ["bench", "--address", "127.0.0.1:1", "--stream-interval", "4", "--output-dir", str(tmp_path)]
    assert runner.main(build_parser().parse_args(argv)) == 0
    (config,) = seen
    assert config.stream_interval == 4
    results = json.loads(gzip.decompress((tmp_path / "bench.json.gz").read_bytes()))
    assert results["parameters"]["address"] == "127.0.0.1:1"
    assert results["machine"]["cpu"]
    assert not (tmp_path / "bench.json").exists()
    assert "[bench.json.gz](bench.json.gz)" in (tmp_path / "report.md").read_text()
