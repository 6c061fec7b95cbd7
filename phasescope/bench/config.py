"""A bench run's configuration: one typed object, built and validated once from the command line.

Everything that determines what a run sends is here, and all of it is written into the
results (`parameters`), so a run is reproduced from its results file alone.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from phasescope.bench.slo import SloError, parse_slo
from phasescope.bench.workload import (
    AdapterMix,
    DatasetPrompt,
    LengthDistribution,
    WorkloadError,
    WorkloadSpec,
    file_sha256,
    read_dataset,
)
from phasescope.telemetry.model.adapter import MAX_LORA_RANKS


class ConfigError(ValueError):
    """Flags that do not make a run; the message is one line for the operator."""


COMPARE_PROTOCOLS = ("all", "phasescope", "engine")
"""What `--compare` adds beside phasescope: `phasescope` (in-process AsyncLLM and vLLM's OpenAI server, against
phasescope.v1), `engine` (vLLM's gRPC worker, against phasescope over the same engine protocol), `all` (both)."""


ENV_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
"""A word that sets an environment variable (NAME=VALUE), as `env` reads the words before a command."""
VARIANT_NAME = re.compile(r"[a-z0-9][a-z0-9-]*")
TARGET_NAMES = ("in-process", "vllm-openai", "phasescope", "vllm-grpc", "vllm-rust", "phasescope-vllm-grpc",
                "vllm-grpc-endpoint", "gateway")  # fmt: skip
"""Every target a run can measure besides the variants, in the order they run."""
ENGINE_PROTOCOL_SUFFIX = "-vllm-grpc"
"""A phasescope server over vLLM's engine protocol is measured under its name and this suffix."""


@dataclass(frozen=True)
class ServeVariant:
    """A phasescope server this run starts: its name as a target, its environment and its extra serve flags."""

    name: str
    env: dict[str, str] = field(default_factory=dict)
    """Set in the server's environment (and its engine's): `PYTHONPATH=<a checkout>` runs that checkout's code."""
    args: tuple[str, ...] = ()
    """`phasescope serve` flags after the run's engine settings."""

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "env": self.env, "args": list(self.args)}


PHASESCOPE = ServeVariant("phasescope")
"""The phasescope server a run starts, as it is: no environment or flags of its own."""


def serve_words(text: str, flag: str) -> tuple[dict[str, str], tuple[str, ...]]:
    """`NAME=VALUE ... --flag value ...`, shell-quoted: the leading NAME=VALUE words are the server's environment,
    the rest its `phasescope serve` flags."""
    try:
        words = shlex.split(text)
    except ValueError as exc:
        raise ConfigError(f"{flag}: {exc}") from None
    env: dict[str, str] = {}
    while words and ENV_WORD.match(words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    return env, tuple(words)


def parse_variant(text: str) -> ServeVariant:
    name, sep, words = text.partition("=")
    if not sep or not VARIANT_NAME.fullmatch(name):
        raise ConfigError(f"--variant: {text!r} is not NAME=WORDS (NAME in lower case, digits and -)")
    if name in TARGET_NAMES or name.endswith(ENGINE_PROTOCOL_SUFFIX):
        raise ConfigError(f"--variant: {name!r} is a target's name already")
    env, args = serve_words(words, "--variant")
    return ServeVariant(name, env, args)


@dataclass(frozen=True)
class BenchConfig:
    points: tuple[tuple[str, float], ...]
    """The sweep's (load, value) points in order: concurrency points, then rates; empty in a search."""
    requests: int
    """Measured requests per run."""
    warmup: int
    """Requests before each point's first run (per target), excluded from the figures."""
    repeats: int
    """Runs per point (rounds), each with its own seed; figures are the median over them, with min and max."""
    seed: int
    """The base seed: every run's seed is derived from it, the point and the repeat."""
    workload: WorkloadSpec
    api: str
    """`prompt` (a completion) or `chat` (the prompt as one user message, through the chat template)."""
    model: str
    """The model folder every target started here serves; empty: the embedded default."""
    tiny_model: bool
    """Serve the 2-layer random-weight Llama (phasescope.bench.tiny_model) instead of `model`."""
    dtype: str
    """The engine's dtype, on every target started here."""
    max_model_len: int
    """Each engine's context limit, tokens."""
    kv_cache_gib: float
    """Each engine's KV cache, GiB."""
    max_num_seqs: int
    """Each engine's batch limit (phasescope's --max-concurrent-requests)."""
    stream_interval: int
    """Tokens per streamed chunk on every target started here (vLLM's stream_interval)."""
    token_ids_only: bool = False
    """phasescope's requests ask for token ids without text (the other targets always detokenise)."""
    slo: dict[str, float] = field(default_factory=dict)
    """Objectives in milliseconds, any of ttft_ms, tpot_ms, e2e_ms."""
    sla_search: str | None = None
    """`rate` or `concurrency`: search for the highest load whose goodput ratio meets `goodput_target`."""
    goodput_target: float = 0.99
    max_points: int = 8
    """The search's budget of points (each run `repeats` times)."""
    search_start: float = 1.0
    search_factor: float = 2.0
    search_tolerance: float = 0.1
    saturation_stop: bool = True
    """Stop a target's rate sweep at the first over-saturated point (phasescope.bench.saturation)."""
    token_times: bool = True
    """Keep every token's arrival time in the per-request records (off: TTFT, TPOT and E2E only)."""
    scrape_interval: float = 2.0
    """Seconds between reads of each target's /metrics during a run (0: once, as it ends)."""
    pin_cpus: bool = False
    """On CPU engines: the client and every target's front end and engine core kept off the workers' CPUs."""
    peer_first: bool = False
    """Start the engine-protocol peer (vLLM's gRPC worker, or its Rust request path) before phasescope's servers
    instead of after: a server's place moves its figures by a few percent here, so a comparison pools both."""
    settle_seconds: float = 0.0
    """Quiet before each run of a point with several targets: the target that ran last goes idle first."""
    baseline: str | None = None
    """The target every other is divided by, round by round; None: vLLM's gRPC worker when measured, else the
    first target (`phasescope.bench.rounds.choose_baseline`)."""
    serve: ServeVariant = PHASESCOPE
    """The phasescope server started here: its environment and extra serve flags."""
    variants: tuple[ServeVariant, ...] = ()
    """More phasescope servers started beside it, each measured under its own name."""
    compare: bool = False
    """Start the peers of `compare_protocol` beside phasescope, interleaved point by point."""
    compare_protocol: str = "all"
    """With `compare`: `phasescope` (in-process AsyncLLM, vLLM's OpenAI server and phasescope over phasescope.v1),
    `engine` (vLLM's gRPC worker and phasescope over vLLM's engine protocol, `vllm-grpc` and
    `phasescope-vllm-grpc`), `all` (the five), or `rust` (vLLM's gRPC worker with smg's Rust request path,
    `vllm-rust`, and phasescope over vLLM's engine protocol)."""
    address: str | None = None
    """A running phasescope (host:port) instead of starting one."""
    metrics_url: str | None = None
    """With `address`: its /metrics."""
    vllm_grpc_address: str | None = None
    """A running `vllm.grpc.engine.VllmEngine` endpoint (host:port; phasescope's or vLLM's worker) measured too,
    as `vllm-grpc-endpoint`; nothing is started for it. Its tokenizer: `model` when given, else its GetModelInfo."""
    gateway_url: str | None = None
    """A running OpenAI-compatible gateway (http://host:port, smg's say) measured too, as `gateway`; nothing is
    started for it, and no CPU figure (no process of ours)."""
    output_dir: Path = Path("loadtests/results/bench")
    prompts_file: str | None = None
    prompts_file_sha256: str | None = None
    command: str = ""
    """The command line that ran, to rerun it."""
    adapter_rank: int = 8
    """With `workload.adapters`: each adapter's rank."""

    @property
    def external(self) -> bool:
        """Whether a running endpoint other than phasescope is named (`vllm_grpc_address`, `gateway_url`)."""
        return bool(self.vllm_grpc_address or self.gateway_url)

    @property
    def starts_phasescope(self) -> bool:
        """A phasescope is started here: no `address`, and either `compare` or no other endpoint named (a run
        with only `vllm_grpc_address` or `gateway_url` measures those alone)."""
        return not self.address and (self.compare or not self.external)

    @property
    def measures_phasescope(self) -> bool:
        """Whether phasescope (started here or at `address`) is measured at all."""
        return bool(self.address) or self.starts_phasescope

    @property
    def engine_peer(self) -> str:
        """vLLM's own worker the engine-protocol comparison starts: its Python servicer, or smg's Rust one."""
        return "vllm-rust" if self.compare_protocol == "rust" else "vllm-grpc"

    @property
    def target_names(self) -> list[str]:
        """What the run measures, in the order it runs them (`phasescope.bench.runner`)."""
        v1_set = not self.compare or self.compare_protocol in ("all", "phasescope")
        engine_pair = self.compare and self.compare_protocol in ("all", "engine", "rust")
        names = ["in-process", "vllm-openai"] if self.compare and v1_set else []
        if self.measures_phasescope:
            servers = [self.serve, *self.variants]
            names += [server.name for server in servers] if v1_set else []
            if engine_pair:
                names += [self.engine_peer, *(server.name + ENGINE_PROTOCOL_SUFFIX for server in servers)]
        names += ["vllm-grpc-endpoint"] if self.vllm_grpc_address else []
        names += ["gateway"] if self.gateway_url else []
        return names

    @property
    def starts_servers(self) -> bool:
        """Whether this run starts anything (and so has engine settings of its own)."""
        return self.compare or self.starts_phasescope

    def parameters(self) -> dict[str, Any]:
        """Every parameter, as written into the results."""
        mix = self.workload.adapter_mix
        return {
            "adapters": self.workload.adapters,
            "adapter_mix": mix.describe() if mix is not None else None,
            "adapter_rank": self.adapter_rank if self.workload.adapters else None,
            "points": [list(point) for point in self.points],
            "requests": self.requests,
            "warmup": self.warmup,
            "repeats": self.repeats,
            "seed": self.seed,
            "prompt_tokens": self.workload.prompt_tokens.describe(),
            "max_tokens": self.workload.output_tokens.describe(),
            "shared_prefix_tokens": self.workload.shared_prefix_tokens,
            "prompts_file": self.prompts_file,
            "prompts_file_sha256": self.prompts_file_sha256,
            "api": self.api,
            "token_ids_only": self.token_ids_only,
            "slo": self.slo,
            "sla_search": self.sla_search,
            "goodput_target": self.goodput_target,
            "max_points": self.max_points,
            "search_start": self.search_start,
            "search_factor": self.search_factor,
            "search_tolerance": self.search_tolerance,
            "saturation_stop": self.saturation_stop,
            "token_times": self.token_times,
            "scrape_interval": self.scrape_interval,
            "pin_cpus": self.pin_cpus,
            "peer_first": self.peer_first,
            "settle_seconds": self.settle_seconds,
            "baseline": self.baseline,
            "serve": self.serve.describe(),
            "variants": [variant.describe() for variant in self.variants],
            "compare": self.compare,
            "compare_protocol": self.compare_protocol if self.compare else None,
            "address": self.address,
            "metrics_url": self.metrics_url,
            "vllm_grpc_address": self.vllm_grpc_address,
            "gateway_url": self.gateway_url,
            "output_dir": str(self.output_dir),
        }


def _adapter_mix(args: argparse.Namespace) -> AdapterMix | None:
    """--adapters, --adapter-mix and --adapter-rank checked: the mix, or None without adapters."""
    if args.adapters < 0:
        raise ConfigError(f"--adapters must be 0 or more, got {args.adapters}")
    if not args.adapters:
        return None
    if args.adapter_rank not in MAX_LORA_RANKS:
        ranks = ", ".join(map(str, MAX_LORA_RANKS))
        raise ConfigError(f"--adapter-rank must be one of {ranks} (vLLM's LoRA kernels), got {args.adapter_rank}")
    others = [flag for flag, given in (("--address", args.address), ("--compare", args.compare),
                                       ("--vllm-grpc-address", args.vllm_grpc_address),
                                       ("--gateway-url", args.gateway_url)) if given]  # fmt: skip
    if others:
        raise ConfigError(
            f"--adapters needs the phasescope started here (it makes the adapters and serves them); drop {others[0]}"
        )
    try:
        return AdapterMix.parse(args.adapter_mix)
    except WorkloadError as exc:
        raise ConfigError(f"--adapter-mix: {exc}") from exc


def _values(text: str, flag: str, kind: type[float] | type[int]) -> list[float]:
    try:
        values = [float(kind(item)) for item in text.split(",") if item.strip()]
    except ValueError:
        raise ConfigError(f"{flag}: {text!r} is not a comma-separated list of {kind.__name__}s") from None
    if any(not value > 0 for value in values):
        raise ConfigError(f"{flag}: every value must be positive, got {text!r}")
    return values


def _host_port(text: str, flag: str) -> str:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{flag}: {text!r} is not HOST:PORT")
    return text


def _http_url(text: str, flag: str) -> str:
    if not text.startswith(("http://", "https://")) or len(text.split("://", 1)[1].strip("/")) == 0:
        raise ConfigError(f"{flag}: {text!r} is not an http:// or https:// URL")
    return text.rstrip("/")


def from_args(args: argparse.Namespace, argv: list[str] | None = None) -> BenchConfig:
    """The run's configuration, or ConfigError naming the flag that is wrong."""
    try:
        slo = parse_slo(args.slo) if args.slo else {}
    except SloError as exc:
        raise ConfigError(f"--slo: {exc}") from exc
    try:
        prompt_tokens = LengthDistribution.parse(args.prompt_tokens)
    except WorkloadError as exc:
        raise ConfigError(f"--prompt-tokens: {exc}") from exc
    try:
        output_tokens = LengthDistribution.parse(str(args.max_tokens))
    except WorkloadError as exc:
        raise ConfigError(f"--max-tokens: {exc}") from exc
    dataset: tuple[DatasetPrompt, ...] = ()
    digest = None
    if args.prompts_file:
        try:
            dataset, digest = tuple(read_dataset(Path(args.prompts_file))), file_sha256(Path(args.prompts_file))
        except WorkloadError as exc:
            raise ConfigError(f"--prompts-file: {exc}") from exc
    for flag, value, least in (("--requests", args.requests, 1), ("--warmup", args.warmup, 0),
                               ("--repeats", args.repeats, 1), ("--max-points", args.max_points, 1),
                               ("--shared-prefix-tokens", args.shared_prefix_tokens, 0)):  # fmt: skip
        if value < least:
            raise ConfigError(f"{flag} must be ≥ {least}, got {value}")
    points: list[tuple[str, float]] = []
    if args.sla_search:
        if not slo:
            raise ConfigError("--sla-search needs --slo (the objectives the goodput ratio counts)")
        if not 0 < args.goodput_target <= 1:
            raise ConfigError(f"--goodput-target must be in (0, 1], got {args.goodput_target}")
        if not (args.search_start > 0 and args.search_factor > 1 and args.search_tolerance > 0):
            raise ConfigError("--search-start must be > 0, --search-factor > 1 and --search-tolerance > 0")
    else:
        points = [("concurrency", c) for c in _values(args.concurrency, "--concurrency", int)]
        points += [("rate", r) for r in _values(args.rates, "--rates", float)]
        points += [("burst", b) for b in _values(args.bursts, "--bursts", int)]
        if not points:
            raise ConfigError("give at least one --concurrency, --rates or --bursts point, or --sla-search")
    if args.metrics_url and not args.address:
        raise ConfigError("--metrics-url goes with --address (a server started here is read on its own)")
    if not args.scrape_interval >= 0:
        raise ConfigError(f"--scrape-interval must be ≥ 0 seconds, got {args.scrape_interval}")
    if args.stream_interval < 1:
        raise ConfigError(f"--stream-interval must be ≥ 1, got {args.stream_interval}")
    if args.tiny_model and args.model:
        raise ConfigError("--tiny-model and --model name two models: give one")
    if args.tiny_model and args.address:
        raise ConfigError("--tiny-model starts the servers it measures; --address serves its own model")
    if args.compare_protocol is not None and not args.compare:
        raise ConfigError("--compare-protocol chooses what --compare adds: give --compare")
    if args.peer_first and not (args.compare and (args.compare_protocol or "all") in ("all", "engine", "rust")):
        raise ConfigError("--peer-first orders the start of the engine-protocol peer --compare adds: give --compare "
                          "(with --compare-protocol all, engine or rust)")  # fmt: skip
    if args.peer_first and args.address:
        raise ConfigError("--peer-first orders the servers started here; the phasescope at --address is up already")
    vllm_grpc_address = _host_port(args.vllm_grpc_address, "--vllm-grpc-address") if args.vllm_grpc_address else None
    gateway_url = _http_url(args.gateway_url, "--gateway-url") if args.gateway_url else None
    if args.tiny_model and (vllm_grpc_address or gateway_url) and not args.compare:
        raise ConfigError("--tiny-model starts the servers it measures; --vllm-grpc-address and --gateway-url "
                          "alone start none (add --compare, or drop --tiny-model)")  # fmt: skip
    if not args.settle >= 0:
        raise ConfigError(f"--settle must be ≥ 0 seconds, got {args.settle}")
    adapter_mix = _adapter_mix(args)
    serve_env, serve_args = serve_words(args.serve_args, "--serve-args")
    variants = tuple(parse_variant(text) for text in args.variant)
    if len({variant.name for variant in variants}) < len(variants):
        raise ConfigError("--variant: each needs a name of its own")
    if (serve_env or serve_args or variants) and args.address:
        raise ConfigError("--serve-args and --variant shape the servers started here; --address is running already")
    argv = sys.argv[1:] if argv is None else argv
    config = BenchConfig(
        points=tuple(points),
        requests=args.requests,
        warmup=args.warmup,
        repeats=args.repeats,
        seed=args.seed,
        workload=WorkloadSpec(
            prompt_tokens, output_tokens, args.shared_prefix_tokens, dataset, args.seed, args.adapters, adapter_mix
        ),
        adapter_rank=args.adapter_rank,
        api=args.api,
        model=args.model,
        tiny_model=args.tiny_model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        kv_cache_gib=args.kv_cache_gib,
        max_num_seqs=args.max_num_seqs,
        stream_interval=args.stream_interval,
        token_ids_only=args.token_ids_only,
        slo=slo,
        sla_search=args.sla_search,
        goodput_target=args.goodput_target,
        max_points=args.max_points,
        search_start=args.search_start,
        search_factor=args.search_factor,
        search_tolerance=args.search_tolerance,
        saturation_stop=args.saturation_stop,
        token_times=args.token_times,
        scrape_interval=args.scrape_interval,
        pin_cpus=args.pin_cpus,
        peer_first=args.peer_first,
        settle_seconds=args.settle,
        baseline=args.baseline,
        serve=ServeVariant("phasescope", serve_env, serve_args),
        variants=variants,
        compare=args.compare,
        compare_protocol=args.compare_protocol or "all",
        address=args.address,
        metrics_url=args.metrics_url,
        vllm_grpc_address=vllm_grpc_address,
        gateway_url=gateway_url,
        output_dir=args.output_dir,
        prompts_file=str(args.prompts_file) if args.prompts_file else None,
        prompts_file_sha256=digest,
        command=shlex.join(["phasescope", *argv]),
    )
    if (serve_env or serve_args or variants) and not config.starts_phasescope:
        raise ConfigError("--serve-args and --variant shape a phasescope started here: this run starts none")
    if config.baseline is not None and config.baseline not in config.target_names:
        raise ConfigError(f"--baseline: {config.baseline!r} is not measured here "
                          f"(this run measures {', '.join(config.target_names)})")  # fmt: skip
    return config
