"""`phasescope hardware`: measure (once, cached) this machine's memory bandwidth and FLOP/s, or list the datasheet."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from server.commands import Subparsers


def add_cli_args(subparsers: Subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("hardware", help="measure (once, cached) this machine's memory bandwidth and FLOP/s")
    parser.add_argument("--list", action="store_true", help="print the datasheet table instead of measuring")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="what to measure (default cpu)")
    parser.add_argument("--dtype", default="float32", help="matmul dtype (default float32, the CPU's serving dtype)")
    parser.add_argument("--threads", type=int, help="threads to measure with (default: the cores this process may use)")
    parser.add_argument("--refresh", action="store_true", help="measure again instead of reading the cache")
    return parser


def cmd(args: argparse.Namespace) -> int:
    from server.default_model import cache_root
    from server.peaks import engine_threads
    from telemetry.hardware import DATASHEET
    from telemetry.probe import cached_measure

    if args.list:
        for key, peaks in DATASHEET.items():
            families = ", ".join(f"{f} {v / 1e12:g} TFLOP/s" for f, v in peaks.flops_per_second.items())
            bandwidth = peaks.memory_bandwidth_bytes_per_second / 1e12
            print(f"{key:>10}  {bandwidth:5.3g} TB/s  {families}  ({peaks.description})")
        return 0
    result, cached = cached_measure(
        cache_root(),
        device=args.device,
        dtype=args.dtype,
        threads=args.threads or engine_threads(),
        refresh=args.refresh,
    )
    peaks = result.peaks()
    print(f"device: {result.device} ({'cached' if cached else 'measured now'}, {result.seconds_taken:.1f} s)")
    print(f"threads: {result.threads}")
    bandwidth = result.memory_bandwidth_bytes_per_second / 1e9
    print(f"memory bandwidth (triad a = b + s×c, 3 × array bytes per pass): {bandwidth:.2f} GB/s")
    print(f"matmul {result.dtype} (2 × n³ FLOPs per product): {result.matmul_flops_per_second / 1e9:.2f} GFLOP/s")
    print(f"ridge point: {peaks.ridge_point_flops_per_byte(result.dtype):.2f} FLOP/byte")
    return 0
