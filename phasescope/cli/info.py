"""`phasescope info`: print the server's health and model information."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from phasescope.cli.connection import add_client_parser, credentials

if TYPE_CHECKING:
    from phasescope.cli import Subparsers


def add_cli_args(subparsers: Subparsers) -> argparse.ArgumentParser:
    return add_client_parser(subparsers, "info", "print the server's health and model information")


def cmd(args: argparse.Namespace) -> int:
    import grpc
    from google.protobuf import text_format

    from phasescope.client.client import Client

    try:
        with Client(args.address, timeout_seconds=args.timeout, credentials=credentials(args)) as client:
            print(f"health: {client.health()}")
            print(text_format.MessageToString(client.model_info()), end="")
    except grpc.RpcError as exc:
        print(f"phasescope info: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    return 0
