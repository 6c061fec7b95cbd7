"""loadtests.transport_floor: each transport's server streams every message and its CPU is read."""

import gzip
import json
from pathlib import Path

import pytest

from loadtests.transport_floor import main


def test_every_transport_streams_its_messages_and_reports_its_server_cpu(tmp_path: Path) -> None:
    out = tmp_path / "floor.json.gz"
    argv = ["--transports", "grpc.aio,grpc.sync,sse", "--streams", "2", "--rate", "20", "--seconds", "1"]
    assert main([*argv, "--output", str(out)]) == 0
    points = json.loads(gzip.decompress(out.read_bytes()))["points"]
    # Each server's log beside the results, named without the results' .json.gz.
    assert sorted(path.name for path in tmp_path.glob("*.log")) == [
        "floor.grpc.aio.log",
        "floor.grpc.sync.log",
        "floor.sse.log",
    ]
    assert [point["transport"] for point in points] == ["grpc.aio", "grpc.sync", "sse"]
    for point in points:
        # Two streams at 20 steps per second for a second: every stream got messages, at most one a step.
        assert 2 <= point["messages"] <= 44, point
        assert point["server_cpu_seconds"] >= 0
        assert point["server_cpu_us_per_message"] is not None


def test_an_unknown_transport_is_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--transports", "grpc.aio,http3"])
    assert exited.value.code == 2
    assert "unknown http3" in capsys.readouterr().err
