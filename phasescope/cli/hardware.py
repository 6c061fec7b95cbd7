"""`phasescope hardware`: measure (once, cached) this machine's memory bandwidth and FLOP/s, or list the datasheet."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from phasescope.cli import Subparsers


def add_cli_args(subparsers: Subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("hardware", help="measure (once, cached) this machine's memory bandwidth and FLOP/s")
    parser.add_argument(
        "--list",
        action="store_true",
        help="print the datasheet table (every row and dtype family) instead of measuring",
    )
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="what to measure (default cpu)")
    parser.add_argument("--dtype", default="float32", help="matmul dtype (default float32, the CPU's serving dtype)")
    parser.add_argument("--threads", type=int, help="threads to measure with (default: the cores this process may use)")
    parser.add_argument("--refresh", action="store_true", help="measure again instead of reading the cache")
    return parser


def cmd(args: argparse.Namespace) -> int:
    from phasescope.engine.default_model import cache_root
    from phasescope.serve.peaks import engine_threads
    from phasescope.telemetry.hardware.probe import cached_measure

    if args.list:
        print_datasheet()
        return 0
    problem = _refusal(args)
    if problem:
        # Bad input gets one line naming what is wrong, never a traceback.
        print(f"phasescope hardware: {problem}", file=sys.stderr)
        return 2
    result, cached = cached_measure(
        cache_root(),
        device=args.device,
        dtype=args.dtype,
        threads=args.threads or engine_threads(),
        refresh=args.refresh,
    )
    peaks = result.peaks()
    array_mib = result.array_bytes / 2**20
    print(f"device: {result.device} ({'cached' if cached else 'measured now'}, {result.seconds_taken:.1f} s)")
    print(f"threads: {result.threads}")
    print(
        f"memory bandwidth, the peak (faster read-only kernel over a {array_mib:.0f} MiB array, 1 × array bytes per "
        f"pass): {result.memory_bandwidth_bytes_per_second / 1e9:.2f} GB/s"
    )
    print(f"  read by a sum: {result.sum_bandwidth_bytes_per_second / 1e9:.2f} GB/s")
    print(f"  read by a matrix-vector product: {result.gemv_bandwidth_bytes_per_second / 1e9:.2f} GB/s")
    print(
        f"memory bandwidth, for comparison (triad a = b + s×c, 3 × array bytes per pass, write-allocate not "
        f"counted): {result.triad_bandwidth_bytes_per_second / 1e9:.2f} GB/s"
    )
    print(
        f"matmul {result.dtype} (n = {result.matmul_size}, 2 × n³ FLOPs per product): "
        f"{result.matmul_flops_per_second / 1e9:.2f} GFLOP/s"
    )
    print(f"ridge point: {peaks.ridge_point_flops_per_byte(result.dtype):.2f} FLOP/byte (peak FLOP/s ÷ read bytes/s)")
    return 0


def _refusal(args: argparse.Namespace) -> str | None:
    """Why the probe cannot run as asked, or None."""
    import torch

    from phasescope.telemetry.model.cost import dtype_bytes

    if args.threads is not None and args.threads < 1:
        return f"--threads must be at least 1, got {args.threads}"
    try:
        dtype_bytes(args.dtype)
    except ValueError as exc:
        return str(exc)
    if not isinstance(getattr(torch, args.dtype.removeprefix("torch."), None), torch.dtype):
        return f"--dtype {args.dtype!r} is not a torch dtype name (e.g. float32, bfloat16, float16)"
    if args.device == "cuda" and not torch.cuda.is_available():
        return "--device cuda: this PyTorch sees no CUDA device (a CPU-only build, or no GPU)"
    return None


def print_datasheet() -> None:
    """Every datasheet row: memory, bandwidth and each dtype family's dense FLOP/s; a family a row lacks shows "-"."""
    from phasescope.telemetry.hardware.peaks import DATASHEET, FAMILIES

    key_width = max(len(key) for key in DATASHEET)
    header = "".join(f"{family:>10}" for family in FAMILIES)
    print(f"{'device':<{key_width}}  {'GiB':>5}  {'TB/s':>6}{header}  (TFLOP/s, dense; fp32 is non-tensor)")
    for key, peaks in DATASHEET.items():
        cells = "".join(
            f"{peaks.flops_per_second[family] / 1e12:>10.6g}" if family in peaks.flops_per_second else f"{'-':>10}"
            for family in FAMILIES
        )
        bandwidth = peaks.memory_bandwidth_bytes_per_second / 1e12
        memory = f"{peaks.memory_bytes / 2**30:>5.0f}" if peaks.memory_bytes else f"{'-':>5}"
        print(f"{key:<{key_width}}  {memory}  {bandwidth:>6.4g}{cells}  {peaks.description}")
    print('Memory is the datasheet\'s "GB", which is binary: GiB (an 80 GB H100 SXM reports 79.6 GiB to NVML).')
    print(
        "A MIG slice is its GPU's row scaled by its share, e.g. --hardware 'h100-sxm mig 3g.40gb': "
        "3/7 of each FLOP/s figure, 4/8 of the bandwidth and of the memory."
    )
