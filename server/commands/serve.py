"""`phasescope serve`: run the gRPC inference server."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from server.commands.logs import configure_logging
from server.config import SettingsError, add_settings_arguments, settings_from

if TYPE_CHECKING:
    from server.commands import Subparsers


def add_cli_args(subparsers: Subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "serve",
        help="run the gRPC inference server",
        description="Run the gRPC inference server. Every flag can also be set as PHASESCOPE_<FLAG>.",
    )
    add_settings_arguments(parser)
    return parser


def cmd(args: argparse.Namespace) -> int:
    try:
        settings = settings_from(args)
    except SettingsError as exc:
        print(f"phasescope serve: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level)
    # gRPC's C core prints INFO lines at shutdown unless told otherwise.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    from server.vllm_adapter.engine import configure_engine_logging

    configure_engine_logging(settings.engine_log_level)
    from server.app import event_loop_factory, serve

    try:
        factory = event_loop_factory(settings.event_loop)
    except SettingsError as exc:
        print(f"phasescope serve: {exc}", file=sys.stderr)
        return 2
    return serve(settings, factory)
