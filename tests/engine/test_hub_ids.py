"""A hub id is resolved to its snapshot in the local Hugging Face cache — never downloaded."""

import json
from pathlib import Path

import huggingface_hub.constants
import pytest

from phasescope.cli.main import main
from phasescope.telemetry.model.cost import model_cost_from_folder, resolve_model_path


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    # The cache layout huggingface_hub writes: models--org--name/{refs/main, snapshots/<revision>/...}.
    repo = tmp_path / "models--example-org--tiny-llama"
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    config = {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": 100,
    }
    (snapshot / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return snapshot


def test_a_cached_hub_id_resolves_to_its_snapshot(hub_cache: Path) -> None:
    assert resolve_model_path("example-org/tiny-llama") == hub_cache
    # Tied embeddings 100 × 64; per layer q, k, v, o 64² each, MLP 3 × 64 × 128, two norms; the final norm.
    expected = 100 * 64 + 2 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64
    assert model_cost_from_folder("example-org/tiny-llama").parameter_count == expected


def test_an_uncached_hub_id_is_one_line_and_nothing_is_downloaded(
    hub_cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["roofline", "--model", "example-org/not-here"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0
    assert "neither a path nor a hub id in the local Hugging Face cache (nothing is downloaded)" in error
