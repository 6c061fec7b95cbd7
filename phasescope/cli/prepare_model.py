"""`phasescope prepare-model`: convert and cache the embedded default model."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from phasescope.cli.logs import configure_logging

if TYPE_CHECKING:
    from phasescope.cli import Subparsers


def add_cli_args(subparsers: Subparsers) -> argparse.ArgumentParser:
    return subparsers.add_parser("prepare-model", help="convert and cache the embedded default model, then exit")


def cmd(args: argparse.Namespace) -> int:
    configure_logging("info")
    from phasescope.engine.default_model import DefaultModelError, ensure_default_model

    try:
        print(ensure_default_model())
    except DefaultModelError as exc:
        print(f"phasescope prepare-model: {exc}", file=sys.stderr)
        return 1
    return 0
