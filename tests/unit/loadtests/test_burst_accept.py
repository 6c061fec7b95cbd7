"""loadtests.burst_accept against its bare grpc.aio server: every request of a burst gets its wait measured."""

import gzip
import json
from pathlib import Path

from loadtests.burst_accept import main


def test_a_burst_against_the_bare_server_reports_every_requests_wait(tmp_path: Path) -> None:
    out = tmp_path / "burst.json.gz"
    assert main(["--bare", "--burst", "16", "--waves", "2", "--output", str(out)]) == 0
    body = json.loads(gzip.decompress(out.read_bytes()))
    assert body["target"] == "bare grpc.aio"
    assert [len(wave) for wave in body["waits_seconds"]] == [16, 16]
    for wave in body["waits_seconds"]:
        # Sorted, and each handler started after its request was sent (one clock: the same machine's).
        assert wave == sorted(wave)
        assert 0 <= wave[0] <= wave[-1] < 30
