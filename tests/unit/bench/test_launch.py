"""What `start_phasescope` starts for a server of the run: its flags after the engine settings, its environment,
its target's name (the process faked)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from phasescope.bench import launch
from phasescope.bench.config import ServeVariant
from phasescope.bench.launch import EngineSettings


class FakeProcess:
    def __init__(self, serve_args: Sequence[str], log_path: Path, *, env: Mapping[str, str] | None = None) -> None:
        self.serve_args = list(serve_args)
        self.env = dict(env or {})
        self.address = "127.0.0.1:7"
        self.metrics_url = "http://127.0.0.1:8/metrics"
        self.process = type("Process", (), {"pid": 42})()

    def wait_serving(self) -> None:
        return None


class FakeTarget:
    def __init__(self, address: str, *args: object, name: str = "", **kwargs: object) -> None:
        self.address = address
        self.name = name or str(args[0])


def test_a_variant_runs_in_its_environment_with_its_flags_last_and_is_measured_under_its_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(launch, "PhasescopeProcess", FakeProcess)
    monkeypatch.setattr(launch, "PhasescopeTarget", FakeTarget)
    monkeypatch.setattr(launch, "VllmEngineTarget", FakeTarget)
    settings = EngineSettings("/models/m", "m", "float32", 2048, 2.0, 64)
    variant = ServeVariant("before", {"PYTHONPATH": "/before"}, ("--event-loop", "asyncio"))
    process, target = launch.start_phasescope(settings, tmp_path / "before.log", variant)
    assert isinstance(process, FakeProcess)
    assert process.env == {"PYTHONPATH": "/before"}
    assert process.serve_args[:2] == ["--enforce-eager", "--model"]
    assert process.serve_args[-2:] == ["--event-loop", "asyncio"]
    assert target.name == "before"
    assert launch.phasescope_engine_target(target.address, None, 42, "/models/m", server="before").name == (
        "before-vllm-grpc"
    )


def test_the_bench_makes_its_adapters_for_the_model_and_serves_them_all_in_one_step(tmp_path: Path) -> None:
    import json as json_module

    from phasescope.bench.launch import adapter_serve_args
    from phasescope.telemetry.model.adapter import read_adapter

    config = {"num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
              "head_dim": 64, "intermediate_size": 256, "vocab_size": 1000}  # fmt: skip
    (tmp_path / "config.json").write_text(json_module.dumps(config))
    args = adapter_serve_args(str(tmp_path), 3, 8, tmp_path / "adapters")
    assert args[0] == "--lora-modules"
    pairs = args[1:4]
    assert [pair.split("=")[0] for pair in pairs] == ["adapter-0", "adapter-1", "adapter-2"]
    assert args[4:] == ("--max-loras", "3", "--max-lora-rank", "8")
    for pair in pairs:
        assert read_adapter(Path(pair.split("=", 1)[1]), config, max_rank=8).rank == 8
