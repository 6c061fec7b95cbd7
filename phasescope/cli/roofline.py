"""`phasescope roofline`: the calculator on the command line, with a running server's live points."""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from phasescope.telemetry.exposition import Samples, fetch_samples
from phasescope.telemetry.hardware.peaks import DATASHEET, HardwarePeaks, PeakSource, dtype_family, lookup_device
from phasescope.telemetry.model.adapter import AdapterError, read_adapter
from phasescope.telemetry.model.capacity import DEFAULT_GPU_MEMORY_UTILIZATION
from phasescope.telemetry.model.cost import (
    ModelCost,
    model_cost_from_folder,
    model_cost_from_numbers,
    resolve_model_path,
)
from phasescope.telemetry.model.disaggregation import DEFAULT_LINK, LINKS, Disaggregation, Link, disaggregation
from phasescope.telemetry.model.lora import DEFAULT_LORA_TARGETS, LoraReport, lora_rows, lora_shape
from phasescope.telemetry.model.roofline import DEFAULT_BATCH_SIZES, RooflineReport, roofline
from phasescope.telemetry.model.speculation import (
    FREE_DRAFTER,
    MAX_SPECULATIVE_TOKENS,
    Drafter,
    Speculation,
    speculation,
)

if TYPE_CHECKING:
    from phasescope.cli import Subparsers


def add_cli_args(subparsers: Subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "roofline",
        help="what a model's decode and prefill can reach on a device",
        description="Decode ceilings per batch size, compute utilisation and idleness, and the batch where decode "
        "turns compute-bound, from the model's size and the device's datasheet peaks.",
    )
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--params", type=float, help="parameter count, e.g. 70e9 (no KV-cache or attention terms)")
    model.add_argument(
        "--model", help="Hugging Face model folder, a bare config.json, or a hub id already in the local cache"
    )
    parser.add_argument("--dtype", default="bf16", help="served dtype: bf16, fp16, fp8, fp32 (default bf16)")
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="KV-cache dtype as vLLM takes it: auto (the served dtype, 16-bit for 8-bit weights), fp8, bf16 …",
    )
    parser.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="devices each layer is split over (default 1)"
    )
    parser.add_argument(
        "--pipeline-parallel-size", type=int, default=1, help="devices the layers are divided between (default 1)"
    )
    parser.add_argument(
        "--hardware",
        help=f"device from the datasheet table: {', '.join(DATASHEET)} (default: the --metrics-url server's "
        "peaks, else h100-sxm)",
    )
    parser.add_argument("--peak-memory-bandwidth", type=float, help="override: peak bytes/s, e.g. 3.35e12")
    parser.add_argument("--peak-flops", type=float, help="override: peak dense FLOP/s, e.g. 989e12")
    parser.add_argument(
        "--device-memory",
        type=float,
        help="override: each device's memory in bytes, e.g. 85.9e9 (the datasheet table has every GPU's)",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=DEFAULT_GPU_MEMORY_UTILIZATION,
        help="share of each device's memory the engine may use, as vLLM's flag (default %(default)s)",
    )
    parser.add_argument(
        "--parameters-in-checkpoint",
        type=_parameter_count,
        help="with --model: parameter count, if no safetensors (e.g. 46.7e9)",
    )
    parser.add_argument(
        "--batch-sizes",
        default=",".join(map(str, DEFAULT_BATCH_SIZES)),
        help="comma-separated decode batch sizes (default %(default)s)",
    )
    parser.add_argument("--context", type=int, default=0, help="context length per sequence in tokens (default 0)")
    parser.add_argument("--prompt-tokens", type=int, default=1024, help="prompt length for the prefill estimate")
    parser.add_argument(
        "--cost-per-hour",
        type=float,
        help="price of one device per hour: adds the cost of a million decoded tokens at each batch size",
    )
    parser.add_argument(
        "--speculative-tokens",
        type=int,
        help="speculative decoding: tokens drafted per step (k ≥ 1; with --acceptance-rate); the drafter is free "
        "unless --draft-model or --draft-cost says what it costs",
    )
    parser.add_argument(
        "--acceptance-rate",
        type=float,
        help="speculative decoding: chance each drafted token is accepted, in [0, 1) (with --speculative-tokens)",
    )
    parser.add_argument(
        "--draft-model",
        help="speculative decoding: the draft model (folder, config.json or cached hub id), costed like --model on "
        "the same device; its k decode steps are added to each verify step",
    )
    parser.add_argument(
        "--draft-cost",
        type=float,
        help="speculative decoding: one draft step's time as a share of the model's decode step at the same batch "
        "(Leviathan et al.'s c, ≥ 0; default 0: a free drafter); instead of --draft-model",
    )
    parser.add_argument(
        "--disaggregate",
        action="store_true",
        help="disaggregated prefill and decode: each pool's capacity, the GPUs a request rate needs and the KV "
        "transfer between them, for --prompt-tokens prompts (with --output-tokens and --request-rate; needs --model)",
    )
    parser.add_argument("--output-tokens", type=int, help="with --disaggregate: tokens each request generates")
    parser.add_argument(
        "--request-rate", type=float, help="with --disaggregate: requests per second the two pools must serve"
    )
    parser.add_argument(
        "--link",
        help=f"with --disaggregate: the link a GPU sends its KV over, one of {', '.join(LINKS)} "
        f"(default {DEFAULT_LINK})",
    )
    parser.add_argument(
        "--link-bandwidth",
        type=float,
        help="with --disaggregate: the link's bytes/s per GPU in one direction, e.g. 50e9; instead of --link",
    )
    parser.add_argument(
        "--lora-rank",
        type=int,
        help="LoRA adapters: each adapter's rank; adds each batch's decode with its sequences spread over "
        "--lora-adapters distinct adapters (needs --model: the projections' sizes come from its config)",
    )
    parser.add_argument(
        "--lora-adapters", type=int, default=1, help="with --lora-rank: distinct adapters per batch (default 1)"
    )
    parser.add_argument(
        "--lora-targets",
        default=",".join(DEFAULT_LORA_TARGETS),
        help=f"with --lora-rank: the adapted projections, comma-separated (default {','.join(DEFAULT_LORA_TARGETS)})",
    )
    parser.add_argument(
        "--lora-adapter",
        type=Path,
        help="LoRA adapters: a real PEFT adapter folder whose rank, targets and stored bytes the adapters have "
        "(checked against --model); instead of --lora-rank",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--plot", type=Path, help="draw the roofline chart to this PNG file")
    parser.add_argument("--metrics-url", help="add a running server's live operating points (its /metrics URL)")
    return parser


def _parameter_count(text: str) -> int:
    """A parameter count as a person writes it: 134515008 or 46.7e9."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text!r}")
    return int(value)


def _cost_and_peaks(args: argparse.Namespace, served: HardwarePeaks | None) -> tuple[ModelCost, HardwarePeaks]:
    """The model's cost and the device's peaks; ValueError names what is missing or unknown.

    `served` are the peaks a running server exports (with --metrics-url): its live points are
    plotted against them unless --hardware names another device.
    """
    if args.tensor_parallel_size < 1 or args.pipeline_parallel_size < 1:
        raise ValueError("--tensor-parallel-size and --pipeline-parallel-size must be at least 1")
    if args.hardware is None and served is not None:
        peaks = served
    else:
        name = args.hardware or "h100-sxm"
        found = lookup_device(name)
        if found is None:
            raise ValueError(f"unknown --hardware {name!r}; known: {', '.join(DATASHEET)}")
        peaks = found
    if args.params is not None:
        cost = model_cost_from_numbers(int(args.params), args.dtype)
    else:
        cost = model_cost_from_folder(args.model, args.dtype, args.parameters_in_checkpoint, args.kv_cache_dtype)
    cost = cost.sharded(args.tensor_parallel_size, args.pipeline_parallel_size)
    if args.device_memory is not None and not args.device_memory > 0:
        raise ValueError(f"--device-memory must be a positive number of bytes, got {args.device_memory}")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}")
    peaks = peaks.with_overrides(args.peak_memory_bandwidth, args.peak_flops, args.device_memory)
    peaks.peak_flops(args.dtype)  # a dtype the device has no figure for is refused here, by name
    return cost, peaks


def _speculation_args(args: argparse.Namespace) -> tuple[int | None, float | None]:
    """--speculative-tokens and --acceptance-rate, both or neither; ValueError names the flag at fault."""
    tokens, rate = args.speculative_tokens, args.acceptance_rate
    if (tokens is None) != (rate is None):
        raise ValueError("--speculative-tokens and --acceptance-rate go together: give both or neither")
    if tokens is not None and tokens < 1:
        raise ValueError(f"--speculative-tokens must be at least 1, got {tokens}")
    if rate is not None and not 0 <= rate < 1:
        raise ValueError(f"--acceptance-rate must be in [0, 1), got {rate}")
    return tokens, rate


def _drafter(args: argparse.Namespace, speculative_tokens: int | None) -> Drafter:
    """--draft-model or --draft-cost (or neither: free), with --speculative-tokens; ValueError names the flag."""
    folder, ratio = args.draft_model, args.draft_cost
    if folder is not None and ratio is not None:
        raise ValueError("--draft-cost and --draft-model are alternatives: give one or neither")
    if speculative_tokens is None and (folder is not None or ratio is not None):
        flag = "--draft-model" if folder is not None else "--draft-cost"
        raise ValueError(f"{flag} needs --speculative-tokens and --acceptance-rate")
    if ratio is not None:
        if not (math.isfinite(ratio) and ratio >= 0):
            raise ValueError(f"--draft-cost must be 0 or more (a draft step ÷ a decode step), got {ratio}")
        return Drafter(cost_ratio=ratio)
    if folder is not None:
        try:
            draft = model_cost_from_folder(folder, args.dtype, None, args.kv_cache_dtype)
        except (ValueError, KeyError, OSError) as exc:
            raise ValueError(f"--draft-model {folder}: {exc}") from exc
        # Split over the same devices as the model it drafts for, its figures per device like the model's.
        return Drafter(model=draft.sharded(args.tensor_parallel_size, args.pipeline_parallel_size), name=folder)
    return FREE_DRAFTER


def _lora(
    args: argparse.Namespace, cost: ModelCost, peaks: HardwarePeaks, batches: tuple[int, ...]
) -> LoraReport | None:
    """--lora-rank (with --lora-adapters and --lora-targets) or --lora-adapter, against --model's config; None
    without either. ValueError names the flag at fault."""
    if args.lora_rank is None and args.lora_adapter is None:
        return None
    flag = "--lora-adapter" if args.lora_adapter is not None else "--lora-rank"
    if args.lora_rank is not None and args.lora_adapter is not None:
        raise ValueError("--lora-rank and --lora-adapter are alternatives: give one")
    if args.model is None:
        raise ValueError(f"{flag} needs --model: the adapted projections' sizes come from the model's config")
    if args.lora_adapters < 1:
        raise ValueError(f"--lora-adapters must be at least 1, got {args.lora_adapters}")
    path = resolve_model_path(args.model)
    config = json.loads((path / "config.json" if path.is_dir() else path).read_text())
    if args.lora_adapter is not None:
        try:
            shape = read_adapter(args.lora_adapter, config, max_rank=2**20)
        except AdapterError as exc:
            raise ValueError(f"--lora-adapter {args.lora_adapter}: {exc}") from exc
    else:
        targets = [target.strip() for target in args.lora_targets.split(",") if target.strip()]
        try:
            shape = lora_shape(config, args.lora_rank, targets, args.dtype)
        except ValueError as exc:
            raise ValueError(f"{flag}: {exc}") from exc
    return lora_rows(cost, peaks, args.dtype, batches, args.context, shape, args.lora_adapters)


def print_lora(lora: LoraReport) -> None:
    """Each batch with its sequences over n distinct adapters, beside the base model's decode."""
    print(
        f"\nLoRA: {lora.adapters} distinct adapter{'s' if lora.adapters != 1 else ''} per batch, rank {lora.rank} of "
        f"{', '.join(lora.targets)}: {lora.adapter_bytes / 1e6:,.2f} MB of matrices each (read once per step per "
        f"distinct adapter), {lora.adapter_flops_per_token / 1e6:,.3f} MFLOP per token"
    )
    print(
        f"{'batch':>6} {'adapters':>8} {'tok/s':>12} {'base tok/s':>12} {'ratio':>7} {'adapter bytes':>14} {'bound':>8}"
    )
    for row in lora.rows:
        print(
            f"{row.batch_size:>6,} {row.distinct_adapters:>8} {row.decode_tokens_per_second_total:>12,.1f} "
            f"{row.base_decode_tokens_per_second_total:>12,.1f} {row.throughput_ratio:>7.3f} "
            f"{row.adapter_share_of_bytes:>13.1%} {row.bound:>8}"
        )


def _disaggregation_args(args: argparse.Namespace) -> tuple[int, float, Link] | None:
    """--output-tokens, --request-rate and the link with --disaggregate (None without it); ValueError names
    the flag at fault."""
    flags = {
        "--output-tokens": args.output_tokens,
        "--request-rate": args.request_rate,
        "--link": args.link,
        "--link-bandwidth": args.link_bandwidth,
    }
    if not args.disaggregate:
        given = [flag for flag, value in flags.items() if value is not None]
        if given:
            raise ValueError(f"{given[0]} needs --disaggregate")
        return None
    if args.params is not None:
        raise ValueError("--disaggregate needs --model: a bare --params has no KV bytes per token to transfer")
    missing = [flag for flag in ("--output-tokens", "--request-rate") if flags[flag] is None]
    if missing:
        raise ValueError(f"--disaggregate needs {' and '.join(missing)}")
    if args.output_tokens < 1:
        raise ValueError(f"--output-tokens must be at least 1, got {args.output_tokens}")
    rate = args.request_rate
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"--request-rate must be a positive number of requests per second, got {rate}")
    if args.link is not None and args.link_bandwidth is not None:
        raise ValueError("--link and --link-bandwidth are alternatives: give one or neither")
    if args.link_bandwidth is not None:
        bandwidth = args.link_bandwidth
        if not (math.isfinite(bandwidth) and bandwidth > 0):
            raise ValueError(f"--link-bandwidth must be a positive number of bytes/s, got {bandwidth}")
        return args.output_tokens, rate, Link("--link-bandwidth", bandwidth, "given on the command line")
    name = args.link or DEFAULT_LINK
    link = LINKS.get(name.lower())
    if link is None:
        raise ValueError(f"unknown --link {name!r}; known: {', '.join(LINKS)}")
    return args.output_tokens, rate, link


def served_peaks(samples: Samples) -> HardwarePeaks | None:
    """The peaks a running server judges its engines against, from its /metrics samples."""
    bandwidth = flops = memory = None
    dtype = source = device = ""
    for (name, label_set), value in samples.items():
        labels = dict(label_set)
        if name == "phasescope_hardware_peak_memory_bandwidth_bytes_per_second":
            bandwidth, source = value, labels.get("source", "")
        elif name == "phasescope_hardware_peak_flops_per_second":
            flops, dtype = value, labels.get("dtype", "")
        elif name == "phasescope_hardware_info":
            device = labels.get("device", "")
        elif name == "phasescope_hardware_memory_bytes":
            memory = value
    if bandwidth is None or flops is None:
        return None
    kind: PeakSource = "measured" if source == "measured" else "datasheet" if source == "datasheet" else "flag"
    return HardwarePeaks(device or "server", bandwidth, {dtype_family(dtype): flops}, kind, device, memory)


def live_points(samples: Samples) -> list[dict[str, Any]]:
    """Operating points (intensity, FLOP/s) per engine and phase from a running server's /metrics."""
    intensity: dict[tuple[str, str], float] = {}
    utilization: dict[tuple[str, str], float] = {}
    peak_flops = 0.0
    for (name, label_set), value in samples.items():
        labels = dict(label_set)
        key = (labels.get("engine", ""), labels.get("phase", ""))
        if name == "phasescope_arithmetic_intensity_flops_per_byte":
            intensity[key] = value
        elif name == "phasescope_compute_utilization_ratio":
            utilization[key] = value
        elif name == "phasescope_hardware_peak_flops_per_second":
            peak_flops = value
    return [
        {
            "engine": engine,
            "phase": phase,
            "arithmetic_intensity_flops_per_byte": value,
            "achieved_flops_per_second": utilization.get((engine, phase), 0.0) * peak_flops,
        }
        for (engine, phase), value in sorted(intensity.items())
        if value > 0
    ]


def print_table(report: RooflineReport, cost_per_hour: float | None = None) -> None:
    out = sys.stdout

    def gb(value: float) -> str:
        return f"{value / 1e9:,.3f} GB"

    print(
        f"device {report.device} ({report.peak_source}): "
        f"{report.peak_memory_bandwidth_bytes_per_second / 1e12:.3g} TB/s, "
        f"{report.peak_flops / 1e12:.4g} TFLOP/s {report.dtype}; ridge point {report.ridge_point_flops_per_byte:.1f} "
        "FLOP/byte (peak FLOP/s ÷ peak bytes/s)",
        file=out,
    )
    devices = report.tensor_parallel_size * report.pipeline_parallel_size
    active = (
        f" ({report.active_parameter_count / 1e9:,.2f}B active per token)"
        if report.active_parameter_count != report.parameter_count
        else ""
    )
    print(
        f"model {report.parameter_count / 1e9:,.2f}B parameters{active}"
        + (
            f"; per device of TP {report.tensor_parallel_size} × PP {report.pipeline_parallel_size} = {devices}"
            if devices > 1
            else ""
        ),
        file=out,
    )
    print(
        f"weights {gb(report.weight_bytes)}; KV cache {report.kv_bytes_per_token:,.0f} bytes/token; "
        f"{report.flops_per_token / 1e9:,.3f} GFLOP/token at context {report.context_length}",
        file=out,
    )
    print(
        "decode step: bytes = weights read (all; a mixture of experts' touched experts) + batch × context × "
        "KV bytes/token; FLOPs = batch × FLOPs/token; "
        "time = max(bytes ÷ peak bytes/s, FLOPs ÷ peak FLOP/s)",
        file=out,
    )
    cap = report.capacity
    if cap is not None:
        kv = (
            f"{cap.kv_capacity_tokens:,} tokens of KV cache = {cap.max_sequences_at_context:,} sequences of "
            f"{max(1, report.context_length):,} tokens"
            if cap.kv_capacity_tokens is not None
            else "no KV figure without the model's shape (use --model)"
        )
        print(
            f"memory {gb(cap.device_memory_bytes)} ({cap.device_memory_bytes / 2**30:,.1f} GiB) per device, "
            f"{cap.memory_utilization:g} usable = "
            f"{gb(cap.usable_bytes)}: weights {gb(cap.weight_bytes)} + activations and runtime "
            f"{gb(cap.reserve_bytes)} (estimate) leave {gb(cap.kv_capacity_bytes)}: {kv}",
            file=out,
        )
    header: tuple[str, ...] = (
        "batch", "tok/s/seq", "tok/s total", "TFLOP/s", "bandwidth", "compute", "idle", "FLOP/byte", "bound",
    )  # fmt: skip
    if cost_per_hour is not None:
        header = (*header, "cost/M tok")
    prices = report.cost_per_million_tokens(cost_per_hour) if cost_per_hour is not None else []
    print("".join(f"{h:>13}" for h in header), file=out)
    for index, row in enumerate(report.rows):
        cells: tuple[str, ...] = (
            f"{row.batch_size}",
            f"{row.decode_tokens_per_second_per_sequence:,.2f}",
            f"{row.decode_tokens_per_second_total:,.1f}",
            f"{row.achieved_flops_per_second / 1e12:,.3f}",
            f"{row.memory_bandwidth_utilization:.1%}",
            f"{row.compute_utilization:.2%}",
            f"{row.compute_idle:.2%}",
            f"{row.arithmetic_intensity_flops_per_byte:,.1f}",
            row.bound if row.fits_in_kv_capacity else "no KV room",
        )
        if prices:
            cells = (*cells, f"{prices[index]:,.4g}")
        print("".join(f"{c:>13}" for c in cells), file=out)
    bound_at = report.compute_bound_batch_size
    print(
        "decode turns compute-bound at batch "
        + (f"{bound_at}" if bound_at is not None else "never (KV-cache traffic grows as fast as the FLOPs)"),
        file=out,
    )
    if cap is not None and cap.max_sequences_at_context is not None:
        wall = report.binding_wall
        print(
            f"the KV cache holds at most {cap.max_sequences_at_context:,} sequences at this context: "
            + (
                "capacity binds first (the batch fills the memory before it reaches the compute roof)"
                if wall == "capacity"
                else "compute binds first"
            ),
            file=out,
        )
    print(
        f"prefill of a {report.prefill_tokens}-token prompt: {report.prefill_seconds * 1e3:,.2f} ms "
        f"({report.prefill_bound}-bound)",
        file=out,
    )
    if report.speculation is not None:
        print_speculation(report.speculation)


def print_speculation(spec: Speculation) -> None:
    out = sys.stdout
    k, rate, c = spec.speculative_tokens, spec.acceptance_rate, spec.draft_cost_ratio
    if spec.draft_model is not None:
        drafter = (
            f"a draft model {spec.draft_model}: its k steps included, c = {c:.4g} of a decode step at batch "
            f"{spec.best_speculative_tokens_batch_size}"
        )
    elif c > 0:
        drafter = f"draft cost c = {c:g} of a decode step"
    else:
        drafter = "a free drafter: the upper bound"
    print(
        f"speculative decoding, k = {k} drafted tokens at acceptance {rate:g} ({drafter}): "
        f"{spec.speculative_tokens_per_step:.4f} tokens emitted per verify step = (1 − a^(k+1)) ÷ (1 − a)",
        file=out,
    )
    costly = spec.draft_model is not None or c > 0
    print(
        f"verify step: {k + 1} positions per sequence through one weight read; time = max(bytes ÷ peak bytes/s, "
        "FLOPs ÷ peak FLOP/s); tok/s = tokens per step ÷ "
        + ("(verify time + k × draft step time)" if costly else "time"),
        file=out,
    )
    if costly:
        print(
            "draft step: "
            + (
                "the draft model's decode step at the same batch and context on the same device"
                if spec.draft_model is not None
                else f"{c:g} × the decode step at the same batch"
            )
            + "; draft ms = k draft steps per round",
            file=out,
        )
    header: tuple[str, ...] = ("batch", "tok/s/seq", "tok/s total", "× decode", "TFLOP/s", "FLOP/byte", "bound")
    if costly:
        header = (*header, "draft ms")
    print("".join(f"{h:>13}" for h in header), file=out)
    for row in spec.rows:
        cells: tuple[str, ...] = (
            f"{row.batch_size}",
            f"{row.speculative_tokens_per_second_per_sequence:,.2f}",
            f"{row.speculative_tokens_per_second_total:,.1f}",
            f"{row.speculative_speedup_ratio:.2f}",
            f"{row.speculative_achieved_flops_per_second / 1e12:,.3f}",
            f"{row.speculative_arithmetic_intensity_flops_per_byte:,.1f}",
            row.speculative_bound,
        )
        if costly:
            cells = (*cells, f"{row.speculative_draft_seconds * 1e3:,.4f}")
        print("".join(f"{cell:>13}" for cell in cells), file=out)
    print(
        f"best k at acceptance {rate:g}, batch {spec.best_speculative_tokens_batch_size}: "
        f"{spec.best_speculative_tokens} ({spec.best_speculative_tokens_per_step:.4f} tokens per step; "
        f"k searched 1..{MAX_SPECULATIVE_TOKENS})",
        file=out,
    )
    stops = spec.speculation_stops_helping_batch_size
    largest = max((row.batch_size for row in spec.rows), default=0)
    print(
        f"speculation stops helping at batch {stops}: from there its tok/s per sequence are no more than plain decode's"
        if stops is not None
        else f"speculation still helps at batch {largest:,}, the largest here",
        file=out,
    )


def _count(number: int, noun: str) -> str:
    return f"{number:,} {noun}" + ("" if number == 1 else "s")


def print_disaggregation(disagg: Disaggregation) -> None:
    out = sys.stdout
    devices = disagg.gpus_per_instance
    print(
        f"disaggregated prefill and decode: {disagg.prompt_tokens:,}-token prompts, {disagg.output_tokens:,} output "
        f"tokens, {disagg.request_rate_per_second:g} requests/s; an instance (TP × PP) is {_count(devices, 'GPU')} "
        "in either pool",
        file=out,
    )
    print(
        f"prefill: {disagg.prefill_seconds * 1e3:,.2f} ms per prompt ({disagg.prefill_bound}-bound): "
        f"{disagg.prefill_requests_per_second_per_instance:,.3f} requests/s per instance, "
        f"{disagg.prefill_requests_per_second_per_gpu:,.3f} per GPU",
        file=out,
    )
    limit = "the KV cache's limit" if disagg.decode_batch_limit == "capacity" else "the compute-bound batch"
    print(
        f"decode: batch {disagg.decode_batch_size:,} at context {disagg.decode_context_length:,} (prompt + output ÷ 2; "
        f"{limit}): {disagg.decode_tokens_per_second_per_instance:,.1f} tok/s ÷ {disagg.output_tokens:,} output "
        f"tokens = {disagg.decode_requests_per_second_per_instance:,.3f} requests/s per instance, "
        f"{disagg.decode_requests_per_second_per_gpu:,.3f} per GPU",
        file=out,
    )
    print(
        f"balance: {disagg.prefill_to_decode_gpu_ratio:,.2f} prefill GPUs per decode GPU "
        "(decode capacity ÷ prefill capacity per GPU)",
        file=out,
    )
    rate = disagg.request_rate_per_second
    print(
        f"at {rate:g} requests/s: prefill {_count(disagg.prefill_instances, 'instance')} = "
        f"{_count(disagg.prefill_gpus, 'GPU')} (⌈{rate:g} ÷ {disagg.prefill_requests_per_second_per_instance:,.3f}⌉), "
        f"decode {_count(disagg.decode_instances, 'instance')} = {_count(disagg.decode_gpus, 'GPU')} "
        f"(⌈{rate:g} ÷ {disagg.decode_requests_per_second_per_instance:,.3f}⌉)",
        file=out,
    )
    print(
        f"KV per request: {disagg.prompt_tokens:,} tokens × {disagg.kv_bytes_per_token:,} bytes = "
        f"{disagg.kv_bytes_per_request / 1e9:,.3f} GB"
        + (f"; {disagg.device_kv_bytes_per_request / 1e6:,.1f} MB on each GPU" if devices > 1 else ""),
        file=out,
    )
    print(
        f"transfer over {disagg.link} ({disagg.link_bandwidth_bytes_per_second / 1e9:,.4g} GB/s per GPU per "
        f"direction; {disagg.link_source}): {disagg.kv_transfer_seconds * 1e3:,.2f} ms"
        + (", each GPU its own shard" if devices > 1 else "")
        + " — the wire floor: no protocol overhead, no layer pipelining",
        file=out,
    )
    print(
        f"TTFT floor = prefill {disagg.prefill_seconds * 1e3:,.2f} ms + transfer "
        f"{disagg.kv_transfer_seconds * 1e3:,.2f} ms = {disagg.ttft_floor_seconds * 1e3:,.2f} ms: "
        f"{disagg.ttft_bound} binds",
        file=out,
    )


def plot(report: RooflineReport, path: Path, live: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bandwidth = report.peak_memory_bandwidth_bytes_per_second
    peak = report.peak_flops
    intensities = [row.arithmetic_intensity_flops_per_byte for row in report.rows]
    spec = report.speculation
    spec_rows = spec.rows if spec is not None else ()
    spec_intensities = [row.speculative_arithmetic_intensity_flops_per_byte for row in spec_rows]
    walls = [report.capacity_row.arithmetic_intensity_flops_per_byte] if report.capacity_row is not None else []
    low = min(
        [
            *intensities,
            *spec_intensities,
            *walls,
            report.ridge_point_flops_per_byte,
            *(p["arithmetic_intensity_flops_per_byte"] for p in live),
        ]
    )
    high = max([*intensities, *spec_intensities, *walls, report.ridge_point_flops_per_byte])
    x_low, x_high = low / 4, high * 4
    figure, axes = plt.subplots(figsize=(8, 5.5), dpi=100)
    xs = [x_low * (x_high / x_low) ** (i / 200) for i in range(201)]
    axes.plot(xs, [min(peak, bandwidth * x) for x in xs], color="black", linewidth=2, label="roofline")
    axes.axvline(report.ridge_point_flops_per_byte, color="grey", linestyle=":", label="ridge point")
    wall = report.capacity_row
    if wall is not None:
        # The largest batch whose KV cache fits: decode reaches no intensity beyond its step's.
        axes.axvline(
            wall.arithmetic_intensity_flops_per_byte,
            color="tab:orange",
            linestyle="--",
            label=f"KV capacity wall (batch {wall.batch_size})",
        )
    axes.scatter(
        intensities,
        [row.achieved_flops_per_second for row in report.rows],
        # A batch whose KV cache does not fit is drawn grey: no deployment of this memory runs it.
        color=["tab:blue" if row.fits_in_kv_capacity else "lightgrey" for row in report.rows],
        zorder=3,
        label="decode",
    )
    for row in report.rows:
        axes.annotate(
            f"B={row.batch_size}",
            (row.arithmetic_intensity_flops_per_byte, row.achieved_flops_per_second),
            textcoords="offset points",
            xytext=(4, -12),
            fontsize=8,
        )
    if live:
        axes.scatter(
            [p["arithmetic_intensity_flops_per_byte"] for p in live],
            [p["achieved_flops_per_second"] for p in live],
            color="tab:red",
            marker="*",
            s=120,
            zorder=4,
            label="live (server)",
        )
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("arithmetic intensity (FLOP/byte)")
    axes.set_ylabel("FLOP/s")
    axes.set_title(f"roofline: {report.device}, {report.dtype} ({report.peak_source} peaks)")
    axes.grid(True, which="both", alpha=0.3)
    if spec is not None:
        # The verify steps of the same batches: k + 1 positions per sequence through one weight read,
        # so (k + 1) × the intensity and FLOP/s while memory-bound.
        axes.scatter(
            spec_intensities,
            [row.speculative_achieved_flops_per_second for row in spec_rows],
            color="tab:green",
            marker="D",
            zorder=3,
            label=f"speculative verify (k={spec.speculative_tokens}, a={spec.acceptance_rate:g})",
        )
        for spec_row in spec_rows:
            axes.annotate(
                f"B={spec_row.batch_size}",
                (
                    spec_row.speculative_arithmetic_intensity_flops_per_byte,
                    spec_row.speculative_achieved_flops_per_second,
                ),
                textcoords="offset points",
                xytext=(-28, 2),
                fontsize=7,
                color="tab:green",
            )
    axes.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def does_not_fit(report: RooflineReport) -> str:
    """One line for a deployment whose weights do not fit, naming the tensor-parallel size that would."""
    cap = report.capacity
    assert cap is not None  # only called for a report whose weights do not fit

    def gb(value: float) -> str:
        return f"{value / 1e9:,.1f} GB"

    where = (
        f"{report.device}'s {gb(cap.device_memory_bytes)} ({cap.memory_utilization:g} usable: {gb(cap.usable_bytes)})"
    )
    devices = (
        f" at TP {report.tensor_parallel_size} × PP {report.pipeline_parallel_size}"
        if report.tensor_parallel_size * report.pipeline_parallel_size > 1
        else ""
    )
    fix = (
        f"the smallest tensor-parallel size that fits is {cap.min_tensor_parallel_size} "
        f"(--tensor-parallel-size {cap.min_tensor_parallel_size})"
        if cap.min_tensor_parallel_size is not None
        else "no tensor-parallel size up to 64 fits it"
    )
    return (
        f"the weights do not fit{devices}: {gb(cap.weight_bytes)} per device, with "
        f"{gb(cap.reserve_bytes)} for activations and runtime, against {where}; {fix}"
    )


def cmd(args: argparse.Namespace) -> int:
    try:
        samples = fetch_samples(args.metrics_url) if args.metrics_url else {}
        cost, peaks = _cost_and_peaks(args, served_peaks(samples))
    except (ValueError, KeyError, OSError) as exc:
        # Bad input gets one line naming what is wrong, never a traceback.
        print(f"phasescope roofline: {exc}", file=sys.stderr)
        return 2
    try:
        batch_sizes = tuple(int(b) for b in args.batch_sizes.split(",") if b.strip())
    except ValueError:
        print(f"phasescope roofline: --batch-sizes must be integers, got {args.batch_sizes!r}", file=sys.stderr)
        return 2
    if args.cost_per_hour is not None and not args.cost_per_hour >= 0:
        print(f"phasescope roofline: --cost-per-hour must be 0 or more, got {args.cost_per_hour}", file=sys.stderr)
        return 2
    if not batch_sizes or min(batch_sizes) < 1 or args.context < 0 or args.prompt_tokens < 1:
        print("phasescope roofline: batch sizes and --prompt-tokens must be ≥ 1, --context ≥ 0", file=sys.stderr)
        return 2
    try:
        speculative_tokens, acceptance_rate = _speculation_args(args)
        drafter = _drafter(args, speculative_tokens)
        disaggregating = _disaggregation_args(args)
        lora = _lora(args, cost, peaks, batch_sizes)
    except (ValueError, OSError) as exc:
        print(f"phasescope roofline: {exc}", file=sys.stderr)
        return 2
    report = roofline(
        cost,
        peaks,
        args.dtype,
        batch_sizes=batch_sizes,
        context_length=args.context,
        prefill_tokens=args.prompt_tokens,
        memory_utilization=args.gpu_memory_utilization,
    )
    if speculative_tokens is not None and acceptance_rate is not None:
        # Beside the rows roofline() kept (none when the weights do not fit), with the drafter's cost.
        batches = tuple(row.batch_size for row in report.rows)
        spec = speculation(cost, peaks, args.dtype, batches, args.context, speculative_tokens, acceptance_rate, drafter)
        report = replace(report, speculation=spec)
    fits = report.capacity is None or report.capacity.weights_fit
    if not fits and not args.json:
        print(f"phasescope roofline: {does_not_fit(report)}", file=sys.stderr)
        return 1
    disagg = None
    if disaggregating is not None and fits:
        output_tokens, request_rate, link = disaggregating
        try:
            disagg = disaggregation(
                cost,
                peaks,
                args.dtype,
                args.prompt_tokens,
                output_tokens,
                request_rate,
                link,
                args.gpu_memory_utilization,
            )
        except ValueError as exc:
            print(f"phasescope roofline: --disaggregate: {exc}", file=sys.stderr)
            return 2
    live = live_points(samples)
    if args.json:
        data = report.to_json()
        if disaggregating is not None:
            # One object, not fields beside the rows: its figures are for whole requests, not a batch size.
            data["disaggregation"] = asdict(disagg) if disagg is not None else None
        if lora is not None:
            data["lora"] = asdict(lora)
        if args.cost_per_hour is not None:
            data["cost_per_hour"] = args.cost_per_hour
            for row, price in zip(data["rows"], report.cost_per_million_tokens(args.cost_per_hour), strict=True):
                row["cost_per_million_tokens"] = price
        if args.metrics_url:
            data["live"] = live
        json.dump(data, sys.stdout, indent=2)
        print()
        if not fits:
            return 1
    else:
        print_table(report, args.cost_per_hour)
        if lora is not None:
            print_lora(lora)
        if disagg is not None:
            print_disaggregation(disagg)
        for point in live:
            print(
                f"live engine {point['engine']} {point['phase']}: {point['arithmetic_intensity_flops_per_byte']:.1f} "
                f"FLOP/byte, {point['achieved_flops_per_second'] / 1e12:.4f} TFLOP/s"
            )
    if args.plot:
        plot(report, args.plot, live)
        print(f"roofline chart written to {args.plot}", file=sys.stderr)
    return 0
