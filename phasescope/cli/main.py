"""`phasescope`: serve a model, talk to a server (generate, tokenize, info, top), measure (roofline, bench)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from phasescope.cli import (
    Subcommand,
    bench,
    generate,
    hardware,
    info,
    prepare_model,
    roofline,
    serve,
    tokenize,
    top,
)

# In the order `phasescope --help` lists them.
SUBCOMMANDS: tuple[Subcommand, ...] = (serve, prepare_model, generate, tokenize, info, top, roofline, bench, hardware)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="phasescope", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    for subcommand in SUBCOMMANDS:
        subcommand.add_cli_args(subparsers).set_defaults(func=subcommand.cmd)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
