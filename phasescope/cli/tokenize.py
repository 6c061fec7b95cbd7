"""`phasescope tokenize`: print the token ids the model sees."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from phasescope.cli.connection import add_client_parser, credentials

if TYPE_CHECKING:
    from phasescope.cli import Subparsers


def add_cli_args(subparsers: Subparsers) -> argparse.ArgumentParser:
    parser = add_client_parser(subparsers, "tokenize", "print the token ids the model sees")
    parser.add_argument("text")
    parser.add_argument("--chat", action="store_true")
    return parser


def cmd(args: argparse.Namespace) -> int:
    import grpc

    from phasescope.client.client import Client

    try:
        with Client(args.address, timeout_seconds=args.timeout, credentials=credentials(args)) as client:
            ids = client.tokenize(chat=[("user", args.text)]) if args.chat else client.tokenize(text=args.text)
    except grpc.RpcError as exc:
        print(f"phasescope tokenize: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    print(f"{len(ids)} tokens: {ids}")
    return 0
