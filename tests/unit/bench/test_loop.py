"""The run loop against a scripted target (the network boundary faked): order, seeds, repeats, search, stop."""

import asyncio
import time
from pathlib import Path

import pytest

from phasescope.bench.config import BenchConfig, from_args
from phasescope.bench.loop import Bench
from phasescope.bench.rounds import collect_rounds, round_ratios
from phasescope.bench.workload import BenchRequest, RequestRecord
from phasescope.cli.main import build_parser


class ScriptedTarget:
    """Streams 4 tokens at once; TTFT is 10 ms up to `limit` concurrency, 5 s beyond (no waiting: fake times)."""

    def __init__(self, name: str, calls: list[tuple[str, str]], limit: float = 1e9) -> None:
        self.name = name
        self.metrics_url: str | None = None
        self.scrape_url: str | None = None
        self.calls = calls
        self.limit = limit
        self.load = 0.0

    async def stream(self, request: BenchRequest, record: RequestRecord) -> None:
        self.calls.append((self.name, request.prompt))
        await asyncio.sleep(0)
        ttft = 0.01 if self.load <= self.limit else 5.0
        record.token_times = [record.sent + ttft + 0.001 * i for i in range(4)]
        record.output_tokens, record.prompt_tokens = 4, 10

    def frontend_cpu_seconds(self) -> float | None:
        return None

    async def close(self) -> None:
        return None


def config(tmp_path: Path, *flags: str) -> BenchConfig:
    argv = ["bench", "--requests", "2", "--warmup", "0", "--settle", "0", "--output-dir", str(tmp_path), *flags]
    return from_args(build_parser().parse_args(argv), argv)


async def test_points_interleave_targets_repeat_by_repeat_with_the_same_prompts(tmp_path: Path) -> None:
    calls: list[tuple[str, str]] = []
    targets = [ScriptedTarget("a", calls), ScriptedTarget("b", calls)]
    bench = Bench(config(tmp_path, "--concurrency", "1,2", "--repeats", "2"), targets)
    await bench.sweep()
    # Point 1: repeat 1 on a then b, repeat 2 on b then a (no target always second); then point 2 likewise.
    assert [name for name, _ in calls] == ["a", "a", "b", "b", "b", "b", "a", "a"] * 2
    runs = [calls[i : i + 4] for i in range(0, 16, 4)]
    for run in runs:
        assert [prompt for _, prompt in run[:2]] == [prompt for _, prompt in run[2:]]
    # Each run (point, repeat) has its own prompts.
    assert len({run[0][1] for run in runs}) == 4
    assert [(p["target"], p["value"], p["repeats"]) for p in bench.points] == [
        ("a", 1.0, 2), ("b", 1.0, 2), ("a", 2.0, 2), ("b", 2.0, 2)]  # fmt: skip
    point = bench.points[0]
    assert [run["repeat"] for run in point["runs"]] == [0, 1]
    assert point["runs"][0]["seed"] != point["runs"][1]["seed"]
    assert set(point["spread"]["output_throughput"]) == {"median", "min", "max"}
    assert len(point["runs"][0]["records"]) == 2


SETTLE = 0.0123  # a pause no target takes, to count the settles


async def test_each_round_runs_every_target_once_on_its_prompts_in_alternating_order_after_a_settle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settles: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(delay: float) -> None:
        if delay == SETTLE:
            settles.append(delay)
        await real_sleep(0)

    monkeypatch.setattr(asyncio, "sleep", sleep)  # the loop's own settle among the targets' sleep(0)
    calls: list[tuple[str, str]] = []
    targets = [ScriptedTarget("vllm-grpc", calls), ScriptedTarget("phasescope-vllm-grpc", calls, limit=-1)]
    bench = Bench(config(tmp_path, "--concurrency", "1", "--rounds", "4", "--settle", str(SETTLE)), targets)
    await bench.sweep()
    order = [name for name, _ in calls[::2]]  # two requests a run
    assert order == ["vllm-grpc", "phasescope-vllm-grpc", "phasescope-vllm-grpc", "vllm-grpc"] * 2
    rounds = [calls[i : i + 4] for i in range(0, 16, 4)]
    for round_ in rounds:  # both targets of a round are sent the same prompts; each round its own
        assert sorted(prompt for _, prompt in round_[:2]) == sorted(prompt for _, prompt in round_[2:])
    assert len({round_[0][1] for round_ in rounds}) == 4
    assert len(settles) == 8  # before every run: a point with several targets
    alone = Bench(config(tmp_path, "--concurrency", "1", "--rounds", "2", "--settle", str(SETTLE)), targets[:1])
    await alone.sweep()
    assert len(settles) == 8  # one target: nothing to wait for
    (row,) = round_ratios(collect_rounds([bench.points]), "vllm-grpc")
    assert (row["target"], row["rounds"]) == ("phasescope-vllm-grpc", 4)
    assert row["figures"]["median_ttft_ms"]["median"] == pytest.approx(500.0, rel=1e-3)  # 5 s ÷ 10 ms


class LoadAwareTarget(ScriptedTarget):
    """Knows the concurrency it is driven at from the number of streams open at once."""

    def __init__(self, name: str, calls: list[tuple[str, str]], limit: float) -> None:
        super().__init__(name, calls, limit)
        self.open = 0

    async def stream(self, request: BenchRequest, record: RequestRecord) -> None:
        self.open += 1
        await asyncio.sleep(0.001)
        self.load = max(self.load, self.open)
        await super().stream(request, record)
        await asyncio.sleep(0.001)
        self.open -= 1
        if self.open == 0:
            self.load = 0


async def test_an_sla_search_on_concurrency_brackets_each_targets_limit(tmp_path: Path) -> None:
    calls: list[tuple[str, str]] = []
    targets = [LoadAwareTarget("a", calls, limit=5), LoadAwareTarget("b", calls, limit=2)]
    settings = config(tmp_path, "--requests", "16", "--slo", "ttft_ms=1000", "--sla-search", "concurrency",
                      "--max-points", "10")  # fmt: skip
    bench = Bench(settings, targets)
    await bench.search()
    plans = bench.plans
    assert plans["a"]["bracket"] == [5.0, 6.0]
    assert plans["b"]["bracket"] == [2.0, 3.0]
    assert plans["a"]["status"] == "bracketed"
    assert plans["a"]["goodput_ratio_at_answer"] == {"median": 1.0, "min": 1.0, "max": 1.0}
    assert plans["a"]["goodput_ratio_at_first_failing"]["median"] == 0.0
    assert all("search_passed" in point for point in bench.points)


async def test_a_burst_point_sends_whole_waves_at_once_and_the_next_only_after_the_last_ends(tmp_path: Path) -> None:
    class Waves(ScriptedTarget):
        def __init__(self) -> None:
            super().__init__("w", [])
            self.open = 0
            self.opened_with: list[int] = []  # streams already open as each request starts

        async def stream(self, request: BenchRequest, record: RequestRecord) -> None:
            self.opened_with.append(self.open)
            self.open += 1
            await asyncio.sleep(0.001 * (request.index % 3))  # a wave's requests end at different times
            await super().stream(request, record)
            self.open -= 1

    target = Waves()
    bench = Bench(config(tmp_path, "--concurrency", "", "--bursts", "4", "--requests", "10"), [target])
    await bench.sweep()
    # Waves of 4, 4 and 2: each starts with nothing open, and all of a wave start before any of it ends.
    assert target.opened_with == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    point = bench.points[0]
    assert (point["load"], point["value"], point["completed"]) == ("burst", 4.0, 10)


async def test_a_rate_sweep_stops_at_the_first_over_saturated_point(tmp_path: Path) -> None:
    class Backlogged(ScriptedTarget):
        """Finishes one request every 50 ms whatever the rate: capacity 20 requests/s."""

        def __init__(self) -> None:
            super().__init__("slow", [])
            self.free_at = 0.0

        async def stream(self, request: BenchRequest, record: RequestRecord) -> None:
            now = time.perf_counter()
            self.free_at = max(self.free_at, now) + 0.05
            await asyncio.sleep(self.free_at - now)
            record.token_times = [time.perf_counter()] * 2
            record.output_tokens = 2

    bench = Bench(config(tmp_path, "--concurrency", "", "--rates", "10,80,160", "--requests", "40"), [Backlogged()])
    await bench.sweep()
    assert [p["value"] for p in bench.points] == [10.0, 80.0]
    stop = bench.plans["slow"]["saturation_stop"]
    assert stop["value"] == 80.0
    assert stop["skipped"] == [160.0]
    assert any("queue faster than they finish" in reason for reason in stop["reasons"])
    assert not bench.points[0]["saturation"]["over_saturated"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--slo", "ttfb_ms=2000"], "phasescope bench: --slo: unknown objective 'ttfb_ms'"),
        (["--slo", "ttft_ms=2000,tpot_ms"], "phasescope bench: --slo: 'tpot_ms' has no '='"),
        (["--sla-search", "rate"], "phasescope bench: --sla-search needs --slo"),
        (["--max-tokens", "uniform:9:1"], "phasescope bench: --max-tokens: uniform needs 1 ≤ low ≤ high"),
        (["--concurrency", "0"], "phasescope bench: --concurrency: every value must be positive"),
        (["--repeats", "0"], "phasescope bench: --repeats must be ≥ 1"),
        (["--tiny-model", "--model", "/m"], "phasescope bench: --tiny-model and --model name two models"),
        (["--tiny-model", "--address", "127.0.0.1:1"], "phasescope bench: --tiny-model starts the servers"),
    ],
)
def test_bad_flags_exit_2_with_one_line(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from phasescope.cli.main import main

    assert main(["bench", "--output-dir", str(tmp_path / "out"), *flags]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(message)
    assert captured.err.count("\n") == 1
    assert not (tmp_path / "out").exists()


class MetricsEndpoint:
    """A loopback /metrics that counts its reads."""

    def __init__(self) -> None:
        import http.server
        import threading

        endpoint = self
        self.reads = 0

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                endpoint.reads += 1
                body = b"# HELP x x\n# TYPE x counter\nx_total 1\n"
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/metrics"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class SlowTarget(ScriptedTarget):
    async def stream(self, request: BenchRequest, record: RequestRecord) -> None:
        await asyncio.sleep(0.5)
        await super().stream(request, record)


@pytest.mark.parametrize(("interval", "least", "most"), [("0.1", 4, 7), ("0", 1, 1)])
async def test_a_server_without_phasescope_metrics_is_still_scraped_on_the_runs_cadence(
    tmp_path: Path, interval: str, least: int, most: int
) -> None:
    # vLLM's OpenAI server pays for its /metrics as phasescope does, or front-end CPU compares unequal work.
    endpoint = MetricsEndpoint()
    try:
        target = SlowTarget("openai-like", [])
        target.scrape_url = endpoint.url
        bench = Bench(config(tmp_path, "--concurrency", "2", "--scrape-interval", interval), [target])
        await bench.sweep()
    finally:
        endpoint.close()
    run = bench.points[0]["runs"][0]
    assert least <= run["metrics_reads"] <= most
    # And once before and once after the run, outside its windows, for its speculative decoding counters.
    assert endpoint.reads == run["metrics_reads"] + 2
    # Not phasescope's /metrics: no server view is read from it; and it counts no speculation.
    assert "server_mean_decode_ms" not in run
    assert "speculative_drafted_tokens" not in run


def test_scrape_interval_must_not_be_negative(tmp_path: Path) -> None:
    from phasescope.bench.config import ConfigError

    with pytest.raises(ConfigError, match="--scrape-interval"):
        config(tmp_path, "--scrape-interval", "-1")
