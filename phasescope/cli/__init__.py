"""The `phasescope` subcommands, one module each, listed and dispatched by `phasescope.cli.main`.

Every module is a `Subcommand`: `add_cli_args` adds its parser to the top-level
subparsers and returns it, `cmd` runs it and returns the exit code. Modules
import what they run inside `cmd`, so `phasescope --help` stays light (no vLLM,
no gRPC server, no matplotlib).
"""

from __future__ import annotations

import argparse
from typing import Protocol, TypeAlias

Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


class Subcommand(Protocol):
    def add_cli_args(self, subparsers: Subparsers) -> argparse.ArgumentParser: ...

    def cmd(self, args: argparse.Namespace) -> int: ...
