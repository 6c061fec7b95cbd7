"""The adapters of --lora-modules are checked before an engine process starts: a folder that is no adapter for
the model stops the server with one line naming the flag and the adapter (served end to end in
tests/integration/test_adapters.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from phasescope.bench.adapters import write_lora_adapter
from phasescope.bench.tiny_model import ensure_tiny_model
from phasescope.engine.base import EngineConfigError, EngineOptions
from phasescope.engine.vllm.engine import _initial_adapters


def tiny_config() -> dict[str, object]:
    config: dict[str, object] = json.loads((ensure_tiny_model() / "config.json").read_text())
    return config


def options(*modules: tuple[str, str]) -> EngineOptions:
    return EngineOptions(lora=True, max_loras=2, max_lora_rank=8, lora_modules=modules)


def test_each_adapter_is_read_and_gets_an_id_of_its_own(tmp_path: Path) -> None:
    a = write_lora_adapter(tmp_path / "a", tiny_config(), rank=8)
    b = write_lora_adapter(tmp_path / "b", tiny_config(), rank=1, targets=("down_proj",))
    adapters = _initial_adapters(options(("a", str(a)), ("b", str(b))), tiny_config())
    assert [(x.name, x.shape.rank, x.shape.targets) for x in adapters.all] == [
        ("a", 8, ("q_proj", "v_proj")), ("b", 1, ("down_proj",)),
    ]  # fmt: skip
    assert [request.lora_int_id for request in adapters.requests] == [1, 2]
    assert adapters.request("") is None
    assert adapters.request("b").lora_path == str(b.resolve())


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda folder: folder, "is not a folder"),
        (
            lambda folder: write_lora_adapter(folder, tiny_config(), rank=16),
            "rank 16 is above the engine's --max-lora-rank 8",
        ),
        (
            lambda folder: write_lora_adapter(folder, {**tiny_config(), "hidden_size": 576}, rank=8),
            "an adapter for another base model",
        ),
    ],
)
def test_a_bad_adapter_is_one_line_naming_the_flag_and_the_pair(tmp_path: Path, make: object, message: str) -> None:
    folder = make(tmp_path / "x")  # type: ignore[operator]
    with pytest.raises(EngineConfigError) as caught:
        _initial_adapters(options(("x", str(folder))), tiny_config())
    text = str(caught.value)
    assert text.startswith(f"--lora-modules: x={folder}: ")
    assert message in text
    assert "\n" not in text
