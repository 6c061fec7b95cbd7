"""What a bench run writes: its raw results gzipped, from the typed configuration (the targets faked); which
targets the flags start and measure, in order (the servers faked)."""

import contextlib
import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from phasescope.bench import runner
from phasescope.bench.config import BenchConfig, ServeVariant, from_args
from phasescope.bench.launch import EngineSettings
from phasescope.bench.rounds import choose_baseline
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


class FakeTarget:
    def __init__(self, name: str, log: list[tuple[str, str]], **seen: Any) -> None:
        self.name = name
        self.log = log
        self.seen = seen
        self.address = seen.get("address", f"{name}:1")
        self.metrics_url = seen.get("metrics_url")

    async def close(self) -> None:
        self.log.append(("close", self.name))


class FakeServer:
    def __init__(self, name: str, log: list[tuple[str, str]], pid: int = 0) -> None:
        self.name = name
        self.log = log
        self.process = type("Process", (), {"pid": pid})()
        log.append(("start", name))

    def stop(self) -> int:
        self.log.append(("stop", self.name))
        return 0


SETTINGS = EngineSettings("/models/m", "m", "float32", 2048, 2.0, 64)


async def targets_of(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *flags: str
) -> tuple[list[Any], list[tuple[str, str]]]:
    """The targets a run of `flags` measures, in order, each server started faked; and what was started,
    stopped and closed (the exit stack unwound)."""
    log: list[tuple[str, str]] = []

    def pair(name: str, target: str, pid: int = 0) -> tuple[FakeServer, FakeTarget]:
        return FakeServer(name, log, pid), FakeTarget(target, log)

    monkeypatch.setattr(runner, "start_in_process", lambda settings, api: FakeTarget("in-process", log))
    monkeypatch.setattr(runner, "start_openai", lambda settings, out, api: pair("openai", "vllm-openai"))
    monkeypatch.setattr(runner, "start_vllm_grpc", lambda settings, out, api: pair("vllm-grpc-worker", "vllm-grpc"))
    monkeypatch.setattr(runner, "start_vllm_rust", lambda settings, out, api: pair("vllm-rust-worker", "vllm-rust"))
    servers = iter(range(42, 100))

    def start_phasescope(
        settings: EngineSettings, path: Path, server: ServeVariant, api: str, token_ids_only: bool
    ) -> tuple[FakeServer, FakeTarget]:
        pid = next(servers)
        target = FakeTarget(server.name, log, address=f"127.0.0.1:{pid}", metrics_url=f"http://127.0.0.1:{pid}/metrics")
        return FakeServer(f"{server.name}-server", log, pid=pid), target

    monkeypatch.setattr(runner, "start_phasescope", start_phasescope)
    monkeypatch.setattr(
        runner, "PhasescopeTarget",
        lambda address, metrics_url, pid, api, token_ids_only: FakeTarget("phasescope", log, address=address,
                                                                          metrics_url=metrics_url),
    )  # fmt: skip
    monkeypatch.setattr(
        runner, "phasescope_engine_target",
        lambda address, metrics_url, pid, tokenizer, api, server: FakeTarget(
            f"{server}-vllm-grpc", log, address=address, metrics_url=metrics_url, pid=pid, tokenizer=tokenizer),
    )  # fmt: skip
    monkeypatch.setattr(runner, "endpoint_tokenizer", lambda address: f"tokenizer of {address}")
    monkeypatch.setattr(
        runner,
        "VllmEngineTarget",
        lambda address, name, tokenizer, api: FakeTarget(name, log, address=address, tokenizer=tokenizer),
    )
    monkeypatch.setattr(runner, "open_gateway", lambda url, api: FakeTarget("gateway", log, address=url))
    argv = ["bench", "--output-dir", str(tmp_path), *flags]
    config = from_args(build_parser().parse_args(argv), argv)

    async with contextlib.AsyncExitStack() as stack:
        targets = await runner._targets(config, SETTINGS if config.starts_servers else None, stack)
    assert [target.name for target in targets] == config.target_names
    return targets, log


async def test_compare_adds_the_engine_protocol_pair_after_todays_three(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    targets, log = await targets_of(monkeypatch, tmp_path, "--compare")
    assert [t.name for t in targets] == ["in-process", "vllm-openai", "phasescope", "vllm-grpc",
                                         "phasescope-vllm-grpc"]  # fmt: skip
    phasescope, engine = targets[2], targets[4]
    # The same phasescope server over both protocols: its address, /metrics and pid; the run's model's tokenizer.
    assert engine.seen == {"address": phasescope.address, "metrics_url": phasescope.metrics_url, "pid": 42,
                           "tokenizer": SETTINGS.model}  # fmt: skip
    started = [name for event, name in log if event == "start"]
    assert sorted(started) == sorted(name for event, name in log if event == "stop")
    assert sorted(t.name for t in targets) == sorted(name for event, name in log if event == "close")


async def test_compare_protocol_narrows_the_peers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    targets, _ = await targets_of(monkeypatch, tmp_path, "--compare", "--compare-protocol", "phasescope")
    assert [t.name for t in targets] == ["in-process", "vllm-openai", "phasescope"]
    targets, log = await targets_of(monkeypatch, tmp_path, "--compare", "--compare-protocol", "engine")
    assert [t.name for t in targets] == ["vllm-grpc", "phasescope-vllm-grpc"]
    # phasescope's server serves the pair's second half; its phasescope.v1 target is closed unmeasured.
    assert ("stop", "phasescope-server") in log
    assert ("close", "phasescope") in log


async def test_named_endpoints_are_measured_as_they_are(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    flags = ("--vllm-grpc-address", "127.0.0.1:9", "--gateway-url", "http://127.0.0.1:10")
    targets, log = await targets_of(monkeypatch, tmp_path, *flags)
    assert [t.name for t in targets] == ["vllm-grpc-endpoint", "gateway"]
    assert not [event for event in log if event[0] == "start"]  # nothing started
    assert targets[0].seen == {"address": "127.0.0.1:9", "tokenizer": "tokenizer of 127.0.0.1:9"}
    assert targets[1].address == "http://127.0.0.1:10"
    targets, _ = await targets_of(monkeypatch, tmp_path, *flags, "--model", "/models/other", "--address", "127.0.0.1:7")
    assert [t.name for t in targets] == ["phasescope", "vllm-grpc-endpoint", "gateway"]
    assert targets[1].seen["tokenizer"] == "/models/other"
    targets, _ = await targets_of(monkeypatch, tmp_path)
    assert [t.name for t in targets] == ["phasescope"]


async def test_variants_start_more_phasescope_servers_each_measured_over_both_protocols(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    flags = ("--compare", "--compare-protocol", "engine", "--serve-args", "PYTHONSAFEPATH=1 PYTHONPATH=/before",
             "--variant", "uvloop=--event-loop uvloop")  # fmt: skip
    targets, log = await targets_of(monkeypatch, tmp_path, *flags)
    assert [t.name for t in targets] == ["vllm-grpc", "phasescope-vllm-grpc", "uvloop-vllm-grpc"]
    # Each server's pid, address and /metrics go to its engine-protocol target.
    assert [t.seen["pid"] for t in targets[1:]] == [42, 43]
    assert targets[2].address == "127.0.0.1:43"
    assert ("start", "uvloop-server") in log
    assert ("stop", "uvloop-server") in log
    targets, _ = await targets_of(monkeypatch, tmp_path, "--variant", "b=--event-loop asyncio")
    assert [t.name for t in targets] == ["phasescope", "b"]


async def test_the_rust_comparison_starts_vllms_worker_with_smgs_rust_request_path_as_the_peer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # phasescope's own Rust mode is a variant: the same engine protocol, the same peer.
    flags = ("--compare", "--compare-protocol", "rust", "--variant", "rust=--front-end rust")
    targets, log = await targets_of(monkeypatch, tmp_path, *flags)
    assert [t.name for t in targets] == ["vllm-rust", "phasescope-vllm-grpc", "rust-vllm-grpc"]
    assert ("start", "vllm-rust-worker") in log
    assert ("start", "vllm-grpc-worker") not in log
    assert choose_baseline([t.name for t in targets]) == "vllm-rust"


async def test_peer_first_starts_the_engine_protocol_peer_before_phasescope_and_keeps_the_rounds_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    flags = ("--compare", "--compare-protocol", "rust", "--variant", "b=--front-end rust")
    _, log = await targets_of(monkeypatch, tmp_path, *flags)
    started = [name for event, name in log if event == "start"]
    assert started == ["phasescope-server", "b-server", "vllm-rust-worker"]
    targets, log = await targets_of(monkeypatch, tmp_path, *flags, "--peer-first")
    started = [name for event, name in log if event == "start"]
    assert started == ["vllm-rust-worker", "phasescope-server", "b-server"]
    # The same targets in the same order (rounds alternate it), each server stopped.
    assert [t.name for t in targets] == ["vllm-rust", "phasescope-vllm-grpc", "b-vllm-grpc"]
    assert sorted(started) == sorted(name for event, name in log if event == "stop")
