"""What the client subcommands (generate, tokenize, info) share: the server address and its credentials."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from phasescope.cli import Subparsers
    from phasescope.client.client import Credentials

DEFAULT_ADDRESS = "127.0.0.1:50051"


def add_client_parser(subparsers: Subparsers, name: str, help_text: str) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(name, help=help_text)
    parser.add_argument("--address", default=DEFAULT_ADDRESS, help=f"server address (default {DEFAULT_ADDRESS})")
    parser.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    parser.add_argument("--ca-file", help="PEM CA of the server's certificate: connect with TLS")
    parser.add_argument("--client-cert", help="PEM client certificate chain, for mutual TLS")
    parser.add_argument("--client-key", help="PEM key of --client-cert")
    parser.add_argument(
        "--token-file", help="file holding a bearer token (default: the PHASESCOPE_TOKEN environment variable)"
    )
    return parser


def credentials(args: argparse.Namespace) -> Credentials:
    from pathlib import Path

    from phasescope.client.client import Credentials
    from phasescope.environment import env_client_token

    token = Path(args.token_file).read_text().strip() if args.token_file else env_client_token()
    return Credentials(
        root_certificates=Path(args.ca_file).read_bytes() if args.ca_file else None,
        client_key=Path(args.client_key).read_bytes() if args.client_key else None,
        client_certificate_chain=Path(args.client_cert).read_bytes() if args.client_cert else None,
        token=token or None,
    )
