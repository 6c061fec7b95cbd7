"""Speculative decoding's acceptance per point: counter deltas from a fake /metrics, through the loop and report."""

from __future__ import annotations

import asyncio
import http.server
import threading
from pathlib import Path
from typing import Any

import pytest

from phasescope.bench.config import BenchConfig, from_args
from phasescope.bench.hardware import speculative_view
from phasescope.bench.loop import Bench
from phasescope.bench.report import latency_rows, write_report
from phasescope.bench.workload import BenchRequest, RequestRecord
from phasescope.cli.main import build_parser
from phasescope.telemetry.exposition import parse_samples

PHASESCOPE = ("phasescope_speculative_drafts", "phasescope_speculative_drafted_tokens",
              "phasescope_speculative_accepted_tokens")  # fmt: skip
VLLM = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")


def exposition(names: tuple[str, str, str], by_engine: dict[str, tuple[float, float, float]]) -> str:
    """The three counters as prometheus_client writes them, one series per engine (and the usual noise)."""
    lines = ["# HELP x_requests x", "# TYPE x_requests counter", "x_requests_total 7"]
    for name, index in zip(names, range(3), strict=True):
        labels = "model_name" if name.startswith("vllm:") else "model"
        lines += [f"# HELP {name} {name}", f"# TYPE {name} counter"]
        for engine, values in by_engine.items():
            lines.append(f'{name}_total{{{labels}="m",engine="{engine}"}} {values[index]}')
            lines.append(f'{name}_created{{{labels}="m",engine="{engine}"}} 1.7e9')
    return "\n".join(lines) + "\n"


def view(names: tuple[str, str, str], before: dict[str, tuple[float, float, float]],
         after: dict[str, tuple[float, float, float]]) -> dict[str, float]:  # fmt: skip
    return speculative_view(parse_samples(exposition(names, before)), parse_samples(exposition(names, after)))


def test_acceptance_is_the_counters_deltas_over_the_run_summed_over_engines() -> None:
    # Over the run: 40 drafts, 120 drafted tokens, 75 accepted (engine 0: 30/90/60, engine 1: 10/30/15).
    got = view(PHASESCOPE, {"0": (100, 300, 200), "1": (5, 15, 9)}, {"0": (130, 390, 260), "1": (15, 45, 24)})
    assert got == {
        "speculative_drafted_tokens": 120,
        "speculative_acceptance_rate": pytest.approx(75 / 120),
        "speculative_mean_acceptance_length": pytest.approx(1 + 75 / 40),
    }


def test_vllms_own_counters_stand_in_when_phasescopes_are_absent() -> None:
    got = view(VLLM, {"0": (0, 0, 0)}, {"0": (8, 24, 12)})
    assert got["speculative_drafted_tokens"] == 24
    assert got["speculative_acceptance_rate"] == pytest.approx(0.5)
    assert got["speculative_mean_acceptance_length"] == pytest.approx(2.5)


def test_phasescopes_counters_win_when_a_server_exports_both() -> None:
    before = exposition(PHASESCOPE, {"0": (0, 0, 0)}) + exposition(VLLM, {"0": (0, 0, 0)})
    after = exposition(PHASESCOPE, {"0": (10, 30, 30)}) + exposition(VLLM, {"0": (10, 30, 0)})
    got = speculative_view(parse_samples(before), parse_samples(after))
    assert got["speculative_acceptance_rate"] == pytest.approx(1.0)


def test_no_counters_no_figures_and_no_drafts_no_ratios() -> None:
    plain = parse_samples("# HELP x x\n# TYPE x counter\nx_total 1\n")
    assert speculative_view(plain, plain) == {}
    # Speculation on but nothing drafted in the run (all prefill, say): the drafted count, no ratio of 0 ÷ 0.
    assert view(VLLM, {"0": (4, 12, 6)}, {"0": (4, 12, 6)}) == {"speculative_drafted_tokens": 0}


def test_a_series_born_during_the_run_counts_from_zero() -> None:
    # phasescope's labelled counters appear at their first increment: absent before, present after.
    got = speculative_view(parse_samples("x_total 1\n"), parse_samples(exposition(PHASESCOPE, {"0": (4, 12, 9)})))
    assert got["speculative_acceptance_rate"] == pytest.approx(0.75)


class SpeculatingServer:
    """A loopback /metrics whose speculative counters the target's requests advance."""

    def __init__(self, names: tuple[str, str, str]) -> None:
        server = self
        self.counts = [0.0, 0.0, 0.0]
        self.names = names

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = exposition(server.names, {"0": (server.counts[0], server.counts[1], server.counts[2])})
                self.send_response(200)
                self.send_header("Content-Length", str(len(body.encode())))
                self.end_headers()
                self.wfile.write(body.encode())

            def log_message(self, *args: object) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/metrics"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class SpeculatingTarget:
    """Each request: one draft of 4 tokens, of which the next of `accepted` were accepted."""

    def __init__(self, server: SpeculatingServer | None, accepted: list[int], phasescope: bool) -> None:
        self.name = "spec"
        self.scrape_url = server.url if server else None
        self.metrics_url = self.scrape_url if phasescope else None
        self._server = server
        self._accepted = list(accepted)

    async def stream(self, request: BenchRequest, record: RequestRecord) -> None:
        await asyncio.sleep(0)
        if self._server:
            self._server.counts[0] += 1
            self._server.counts[1] += 4
            self._server.counts[2] += self._accepted.pop(0)
        record.token_times = [record.sent + 0.01 + 0.001 * i for i in range(4)]
        record.output_tokens, record.prompt_tokens = 4, 10

    def frontend_cpu_seconds(self) -> float | None:
        return None

    async def close(self) -> None:
        return None


def config(tmp_path: Path, *flags: str) -> BenchConfig:
    argv = ["bench", "--requests", "2", "--warmup", "0", "--settle", "0", "--output-dir", str(tmp_path),
            "--concurrency", "2", "--scrape-interval", "0", *flags]  # fmt: skip
    return from_args(build_parser().parse_args(argv), argv)


@pytest.mark.parametrize(("names", "phasescope"), [(PHASESCOPE, True), (VLLM, False)])
async def test_each_round_keeps_its_acceptance_and_the_point_the_median(
    tmp_path: Path, names: tuple[str, str, str], phasescope: bool
) -> None:
    # Three rounds of 2 requests: 2/4, 3/4 and 1/4 accepted per draft.
    server = SpeculatingServer(names)
    try:
        target = SpeculatingTarget(server, [2, 2, 3, 3, 1, 1], phasescope)
        bench = Bench(config(tmp_path, "--rounds", "3"), [target])
        await bench.sweep()
    finally:
        server.close()
    (point,) = bench.points
    rates = [run["speculative_acceptance_rate"] for run in point["runs"]]
    assert rates == pytest.approx([0.5, 0.75, 0.25])
    assert [run["speculative_mean_acceptance_length"] for run in point["runs"]] == pytest.approx([3.0, 4.0, 2.0])
    assert [run["speculative_drafted_tokens"] for run in point["runs"]] == [8, 8, 8]
    assert point["speculative_acceptance_rate"] == pytest.approx(0.5)
    assert point["speculative_mean_acceptance_length"] == pytest.approx(3.0)
    assert point["spread"]["speculative_acceptance_rate"] == pytest.approx({"median": 0.5, "min": 0.25, "max": 0.75})


async def test_a_target_without_speculation_or_metrics_has_no_acceptance(tmp_path: Path) -> None:
    bench = Bench(config(tmp_path), [SpeculatingTarget(None, [], phasescope=False)])
    await bench.sweep()
    (point,) = bench.points
    assert not [name for name in (*point, *point["runs"][0]) if name.startswith("speculative_")]


def point(target: str, acceptance: tuple[float, float] | None) -> dict[str, Any]:
    figures: dict[str, Any] = {
        "target": target, "load": "concurrency", "value": 4.0, "repeats": 1, "request_throughput": 1.0,
        "output_throughput": 60.0, "median_ttft_ms": 100.0, "p99_ttft_ms": 150.0, "median_tpot_ms": 60.0,
        "median_e2el_ms": 4000.0, "errors": 0, "saturation": {"over_saturated": False}, "spread": {},
    }  # fmt: skip
    if acceptance is not None:
        figures["speculative_acceptance_rate"], figures["speculative_mean_acceptance_length"] = acceptance
        figures["speculative_drafted_tokens"] = 1200
    return figures


def test_the_report_shows_an_accepted_column_only_when_a_point_has_acceptance(tmp_path: Path) -> None:
    header, rows = latency_rows([point("vllm-grpc", None), point("phasescope", (0.625, 2.875))], {})
    column = header.index("accepted")
    assert [row[column] for row in rows] == ["—", "62.5 % · 2.9 tok/step"]
    header, _ = latency_rows([point("vllm-grpc", None), point("phasescope", None)], {})
    assert "accepted" not in header

    results = {"command": "phasescope bench", "started": "2026-12-01T10:00:00+00:00",
               "parameters": {"repeats": 1, "requests": 16}, "machine": {}, "formulas": {}, "slo": {},
               "points": [point("phasescope", (0.625, 2.875))]}  # fmt: skip
    report = write_report(results, [], tmp_path).read_text()
    assert "| accepted |" in report
    assert "| 62.5 % · 2.9 tok/step |" in report
