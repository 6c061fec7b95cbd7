"""The roofline's arithmetic against one GPU, without vLLM: emulated decode and prefill steps of a model shape.

A step here is what a transformer's step spends almost all its weight traffic
on: per layer the QKV, attention-output, gate+up and down projections, then
the LM head, as bf16 GEMMs against weight matrices of the model's real sizes
(Llama-3.1-8B by default, or `--config config.json`). Attention over a KV
cache, norms and activations are left out, so the check is of the roofline
itself, not of a serving engine. For each decode batch size (one token per
sequence) and each prefill prompt length (one sequence; the LM head on its
last token only, as engines do) it

- times the step with CUDA events (warm-up, then repeats; the median counts)
  and keeps stepping for at least `--min-seconds` and one GPM interval;
- predicts the step from the GEMM shapes it runs, with the roofline:
  bytes = weight bytes read + activation bytes read and written,
  FLOPs = 2 × rows × weight elements, time = max(bytes ÷ peak bandwidth,
  FLOPs ÷ peak FLOP/s);
- gives the modelled utilisations, predicted bytes and FLOPs ÷ measured time
  ÷ peaks (MBU, MFU), beside what NVML GPM measured meanwhile with the
  server's own `GpmSampler`: DRAM bandwidth utilisation, tensor and SM
  activity (Hopper or newer, with nvidia-ml-py; null elsewhere).

    .venv/bin/python -m loadtests.gpu_roofline_check --output results.json

On a CPU (`--device cpu`, tiny shapes, peaks from `--peak-*` flags) it runs
as a smoke test of itself; GPM columns are null there.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from phasescope.telemetry.hardware.gpu_counters import GpmReading, GpmSampler, engine_gpus, gpm_capable, load_nvml
from phasescope.telemetry.hardware.peaks import lookup_device

DTYPE = torch.bfloat16
ELEMENT_BYTES = 2
DEFAULT_DECODE_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DEFAULT_PROMPT_LENGTHS = {"cuda": (128, 512, 2048, 8192), "cpu": (16, 64)}
# Headroom left free on the GPU when choosing how many layers fit: the CUDA context, cuBLAS workspaces.
GPU_HEADROOM_BYTES = 2 * 2**30
STEPS_PER_SYNC = 8
GPM_SERIES = {
    "phasescope_gpu_dram_bandwidth_utilization_ratio": "gpm_dram_bandwidth_utilization",
    "phasescope_gpu_tensor_active_ratio": "gpm_tensor_active",
    "phasescope_gpu_sm_active_ratio": "gpm_sm_active",
}


@dataclass(frozen=True, slots=True)
class ModelShape:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int


LLAMA_3_1_8B = ModelShape(
    hidden_size=4096,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    intermediate_size=14336,
    vocab_size=128256,
)


@dataclass(frozen=True, slots=True)
class Gemm:
    """y[rows × out] = x[rows × in] · Wᵀ, W stored [out × in] as in a checkpoint."""

    name: str
    in_features: int
    out_features: int


def layer_gemms(shape: ModelShape) -> tuple[Gemm, ...]:
    attention_width = shape.num_heads * shape.head_dim
    return (
        # Grouped-query attention: query heads plus one K and one V per KV head.
        Gemm("qkv_proj", shape.hidden_size, (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim),
        Gemm("o_proj", attention_width, shape.hidden_size),
        Gemm("gate_up_proj", shape.hidden_size, 2 * shape.intermediate_size),
        Gemm("down_proj", shape.intermediate_size, shape.hidden_size),
    )


def lm_head(shape: ModelShape) -> Gemm:
    return Gemm("lm_head", shape.hidden_size, shape.vocab_size)


@dataclass(frozen=True, slots=True)
class StepCost:
    weight_bytes: int
    activation_bytes: int
    flops: int

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.activation_bytes


def gemm_cost(gemm: Gemm, rows: int) -> StepCost:
    # One GEMM reads its weights once, reads rows × in activations and writes rows × out;
    # it does one multiply and one add per weight per row.
    return StepCost(
        weight_bytes=gemm.in_features * gemm.out_features * ELEMENT_BYTES,
        activation_bytes=rows * (gemm.in_features + gemm.out_features) * ELEMENT_BYTES,
        flops=2 * rows * gemm.in_features * gemm.out_features,
    )


def step_cost(shape: ModelShape, layers: int, rows: int, head_rows: int) -> StepCost:
    """What one emulated step moves and computes: `layers` layers on `rows` tokens, the LM head on `head_rows`."""
    costs = [gemm_cost(gemm, rows) for gemm in layer_gemms(shape)] * layers + [gemm_cost(lm_head(shape), head_rows)]
    return StepCost(
        weight_bytes=sum(cost.weight_bytes for cost in costs),
        activation_bytes=sum(cost.activation_bytes for cost in costs),
        flops=sum(cost.flops for cost in costs),
    )


@dataclass(frozen=True, slots=True)
class Peaks:
    memory_bandwidth_bytes_per_second: float
    memory_bandwidth_source: str
    flops_per_second: float
    flops_source: str
    description: str


@dataclass(frozen=True, slots=True)
class Prediction:
    seconds: float
    bound: str


def predict(cost: StepCost, peaks: Peaks) -> Prediction:
    # The step lasts as long as its slower resource needs: streaming the bytes or doing the FLOPs.
    memory_seconds = cost.bytes / peaks.memory_bandwidth_bytes_per_second
    compute_seconds = cost.flops / peaks.flops_per_second
    return Prediction(
        max(memory_seconds, compute_seconds), "memory" if memory_seconds >= compute_seconds else "compute"
    )


def shape_from_config(config: Mapping[str, object]) -> ModelShape:
    """The GEMM shape of a Hugging Face `config.json`; a nested `text_config` wins, as in the cost model."""
    nested = config.get("text_config")
    if isinstance(nested, Mapping):
        config = {**config, **nested}

    def integer(name: str, default: int | None = None) -> int:
        value = config.get(name, default)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"the model config lacks an integer {name}")
        return value

    heads = integer("num_attention_heads")
    hidden = integer("hidden_size")
    return ModelShape(
        hidden_size=hidden,
        num_layers=integer("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=integer("num_key_value_heads", heads),
        head_dim=integer("head_dim", hidden // heads),
        intermediate_size=integer("intermediate_size"),
        vocab_size=integer("vocab_size"),
    )


class EmulatedModel:
    """Random bf16 weights of `layers` layers and the LM head; a step runs every GEMM once."""

    def __init__(self, shape: ModelShape, layers: int, device: torch.device) -> None:
        self.shape = shape
        self.layers = layers
        self.device = device
        self.gemms = layer_gemms(shape)
        self.head = lm_head(shape)
        # Values only matter to power draw (zeros would flatter the clocks); 0.02 as in initialised checkpoints.
        self.layer_weights = [[self._weight(gemm) for gemm in self.gemms] for _ in range(layers)]
        self.head_weight = self._weight(self.head)

    def _weight(self, gemm: Gemm) -> torch.Tensor:
        return torch.empty(gemm.out_features, gemm.in_features, dtype=DTYPE, device=self.device).normal_(0.0, 0.02)

    def step_for(self, rows: int, head_rows: int) -> Callable[[], None]:
        """A step on `rows` tokens, activation buffers allocated once, outside the timed region."""

        def buffers(gemm: Gemm, count: int) -> tuple[torch.Tensor, torch.Tensor]:
            inputs = torch.randn(count, gemm.in_features, dtype=DTYPE, device=self.device)
            return inputs, torch.empty(count, gemm.out_features, dtype=DTYPE, device=self.device)

        layer_buffers = [buffers(gemm, rows) for gemm in self.gemms]
        head_input, head_output = buffers(self.head, head_rows)

        def step() -> None:
            for weights in self.layer_weights:
                for weight, (inputs, outputs) in zip(weights, layer_buffers, strict=True):
                    torch.mm(inputs, weight.t(), out=outputs)
            torch.mm(head_input, self.head_weight.t(), out=head_output)

        return step


def layers_that_fit(shape: ModelShape, largest_rows: int) -> int:
    """How many layers' weights fit in the GPU's free memory beside the LM head and the largest step's buffers."""
    free_bytes, _ = torch.cuda.mem_get_info()
    per_layer = sum(gemm_cost(gemm, 0).weight_bytes for gemm in layer_gemms(shape))
    # A step's buffers are the same for every layer (reused), so one layer's worth at the largest row count.
    buffers = step_cost(shape, 1, largest_rows, largest_rows).activation_bytes
    room = free_bytes - GPU_HEADROOM_BYTES - gemm_cost(lm_head(shape), 0).weight_bytes - buffers
    return max(0, min(shape.num_layers, room // per_layer))


class GpmWindow:
    """NVML GPM over one stretch of steps: a first sample, an interval, a second, on a thread of its own."""

    def __init__(self, sampler: GpmSampler) -> None:
        self._sampler = sampler
        self._opened_at = time.monotonic()
        self._thread = threading.Thread(target=sampler.sample_once, name="gpm-window", daemon=True)
        self._thread.start()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def readings(self) -> dict[str, float | None]:
        self._thread.join()
        # Only values measured in this window (a failed sample leaves the previous row's values behind).
        fresh: list[GpmReading] = [
            reading for reading in self._sampler.readings() if reading.measured_at_seconds >= self._opened_at
        ]
        values: dict[str, float | None] = dict.fromkeys(GPM_SERIES.values())
        for reading in fresh:
            values[GPM_SERIES[reading.series]] = reading.ratio
        return values


@dataclass(frozen=True, slots=True)
class Timing:
    median_seconds: float
    min_seconds: float
    steps_timed: int
    gpm: dict[str, float | None]


def time_step(
    step: Callable[[], None],
    device: torch.device,
    warmup: int,
    repeats: int,
    min_seconds: float,
    sampler: GpmSampler | None,
) -> Timing:
    """Median step time over at least `repeats` steps and `min_seconds`, and the GPM window inside them."""
    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    window = GpmWindow(sampler) if sampler is not None else None
    started = time.perf_counter()
    seconds: list[float] = []
    while (
        len(seconds) < repeats or time.perf_counter() - started < min_seconds or not (window is None or window.done())
    ):
        seconds.extend(_timed_steps(step, device))
    gpm = window.readings() if window is not None else dict.fromkeys(GPM_SERIES.values())
    return Timing(statistics.median(seconds), min(seconds), len(seconds), gpm)


def _timed_steps(step: Callable[[], None], device: torch.device) -> list[float]:
    if device.type != "cuda":
        started = time.perf_counter()
        step()
        return [time.perf_counter() - started]
    # Several steps queued back to back between synchronisations, so the GPU does not idle
    # between them; each is bracketed by its own pair of events.
    events = []
    for _ in range(STEPS_PER_SYNC):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # as above
        start.record()
        step()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return [start.elapsed_time(end) / 1000.0 for start, end in events]


def resolve_peaks(device_name: str, bandwidth_flag: float | None, flops_flag: float | None) -> Peaks:
    """The datasheet row for the device (phasescope.telemetry.hardware.peaks), each figure overridden by its flag."""
    datasheet = lookup_device(device_name)
    if datasheet is None:
        if bandwidth_flag is None or flops_flag is None:
            raise ValueError(f"no datasheet peaks for {device_name!r}: give --peak-memory-bandwidth and --peak-flops")
        return Peaks(bandwidth_flag, "flag", flops_flag, "flag", device_name)
    return Peaks(
        memory_bandwidth_bytes_per_second=bandwidth_flag or datasheet.memory_bandwidth_bytes_per_second,
        memory_bandwidth_source="flag" if bandwidth_flag else datasheet.source,
        flops_per_second=flops_flag or datasheet.peak_flops("bf16"),
        flops_source="flag" if flops_flag else datasheet.source,
        description=datasheet.description,
    )


def open_gpm(interval_seconds: float) -> tuple[GpmSampler | None, dict[str, Any]]:
    """A sampler of the GPU torch uses, found the way the server finds the engine's; None where GPM is not there."""
    cuda_index = torch.cuda.current_device()
    properties = torch.cuda.get_device_properties(cuda_index)
    torch_uuid = getattr(properties, "uuid", None)
    about: dict[str, Any] = {
        "interval_seconds": interval_seconds,
        "torch_uuid": str(torch_uuid) if torch_uuid is not None else None,
        "uuid": None,
        "driver_version": None,
    }
    nvml = load_nvml()
    if nvml is None:
        about["note"] = "no NVML (nvidia-ml-py not installed, or no driver)"
        return None, about
    about["driver_version"] = str(nvml.nvmlSystemGetDriverVersion())
    devices = [device for device in engine_gpus(nvml, os.environ) if device.cuda_index == cuda_index]
    if devices:
        about["uuid"] = devices[0].uuid
    if about["torch_uuid"] and about["uuid"]:
        # The server maps CUDA_VISIBLE_DEVICES to NVML by UUID: torch's own UUID checks that mapping here.
        about["uuid_matches_torch"] = _bare_uuid(about["uuid"]) == _bare_uuid(about["torch_uuid"])
    capable = gpm_capable(nvml, devices)
    if not capable:
        about["note"] = "this GPU has no NVML GPM support (Hopper or newer needed)"
        return None, about
    about["note"] = "measured"
    return GpmSampler(nvml, capable, "gpu_roofline_check", interval_seconds), about


def _bare_uuid(uuid: str) -> str:
    return uuid.lower().removeprefix("gpu-").removeprefix("mig-")


def default_output() -> Path:
    out = os.environ.get("OUT")
    return Path(out) / "gpu_roofline_check.json" if out else Path("gpu_roofline_check.json")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument(
        "--config", type=Path, help="a Hugging Face config.json or model folder (default: Llama-3.1-8B's shape)"
    )
    for flag, field_name in (
        ("--hidden", "hidden_size"),
        ("--heads", "num_heads"),
        ("--kv-heads", "num_kv_heads"),
        ("--head-dim", "head_dim"),
        ("--intermediate", "intermediate_size"),
        ("--vocab", "vocab_size"),
    ):
        parser.add_argument(flag, dest=field_name, type=int, help=f"override the shape's {field_name}")
    parser.add_argument(
        "--layers", type=int, help="layers to allocate and run (default: all the model has, or as many as fit)"
    )
    parser.add_argument("--batch-sizes", default=",".join(map(str, DEFAULT_DECODE_BATCH_SIZES)))
    parser.add_argument("--prompt-lengths", help="prefill prompt lengths (default: 128,512,2048,8192; cpu: 16,64)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before each row")
    parser.add_argument("--repeats", type=int, default=10, help="timed steps at least, per row")
    parser.add_argument("--min-seconds", type=float, default=1.0, help="keep stepping at least this long per row")
    parser.add_argument("--gpm-interval", type=float, default=1.0, help="seconds between the two GPM samples")
    parser.add_argument("--peak-memory-bandwidth", type=float, help="override: peak bytes/s, e.g. 4.8e12")
    parser.add_argument("--peak-flops", type=float, help="override: peak dense bf16 FLOP/s, e.g. 989e12")
    parser.add_argument("--output", type=Path, default=None, help="JSON results (default: $OUT/ or ./ …json)")
    return parser.parse_args(list(argv))


def integers(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    shape = LLAMA_3_1_8B
    if args.config is not None:
        config_path = args.config / "config.json" if args.config.is_dir() else args.config
        try:
            shape = shape_from_config(json.loads(config_path.read_text()))
        except (OSError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
            print(f"{config_path}: {exc}", file=sys.stderr)
            return 2
    overrides = {
        name: getattr(args, name)
        for name in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "vocab_size")
        if getattr(args, name) is not None
    }
    shape = replace(shape, **overrides)
    batch_sizes = integers(args.batch_sizes)
    prompt_lengths = integers(args.prompt_lengths) if args.prompt_lengths else list(DEFAULT_PROMPT_LENGTHS[args.device])
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU, or give --device cpu with a tiny shape", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or platform.machine()
    try:
        peaks = resolve_peaks(device_name, args.peak_memory_bandwidth, args.peak_flops)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2

    largest_rows = max([*batch_sizes, *prompt_lengths])
    layers = args.layers or shape.num_layers
    if device.type == "cuda" and args.layers is None:
        layers = layers_that_fit(shape, largest_rows)
        if layers < shape.num_layers:
            print(f"only {layers} of {shape.num_layers} layers fit in free GPU memory: running {layers}")
    if layers < 1:
        print("not even one layer fits in memory", file=sys.stderr)
        return 2
    sampler, gpm = open_gpm(args.gpm_interval) if device.type == "cuda" else (None, {"note": "no GPM on a CPU"})

    started = time.monotonic()
    model = EmulatedModel(shape, layers, device)
    weight_bytes = step_cost(shape, layers, 0, 0).weight_bytes
    l2_bytes = (
        getattr(torch.cuda.get_device_properties(device), "L2_cache_size", None) if device.type == "cuda" else None
    )
    print(
        f"{device_name}: {layers} of {shape.num_layers} layers (hidden {shape.hidden_size}, intermediate "
        f"{shape.intermediate_size}, vocab {shape.vocab_size}), {weight_bytes / 1e9:.2f} GB of bf16 weights"
        + (f" ({weight_bytes / l2_bytes:.0f}× the L2 cache)" if l2_bytes else "")
        + f"; peaks {peaks.memory_bandwidth_bytes_per_second / 1e12:.2f} TB/s ({peaks.memory_bandwidth_source}), "
        f"{peaks.flops_per_second / 1e12:.0f} TFLOP/s bf16 ({peaks.flops_source}); GPM: {gpm['note']}"
    )
    print(
        f"{'phase':8} {'rows':>5} {'measured ms':>11} {'predicted ms':>12} {'bound':>7} "
        f"{'MBU':>6} {'MFU':>6} {'GPM DRAM':>8} {'GPM tensor':>10}"
    )

    rows: list[dict[str, Any]] = []
    plan = [("decode", size, size, size) for size in batch_sizes] + [
        ("prefill", 1, length, 1) for length in prompt_lengths
    ]
    try:
        for phase, sequences, tokens, head_rows in plan:
            cost = step_cost(shape, layers, tokens, head_rows)
            prediction = predict(cost, peaks)
            timing = time_step(
                model.step_for(tokens, head_rows), device, args.warmup, args.repeats, args.min_seconds, sampler
            )
            row = {
                "phase": phase,
                "sequences": sequences,
                "tokens": tokens,
                "weight_bytes": cost.weight_bytes,
                "activation_bytes": cost.activation_bytes,
                "bytes_per_step": cost.bytes,
                "flops_per_step": cost.flops,
                "arithmetic_intensity_flops_per_byte": cost.flops / cost.bytes,
                "predicted_seconds": prediction.seconds,
                "predicted_bound": prediction.bound,
                "measured_seconds": timing.median_seconds,
                "measured_seconds_min": timing.min_seconds,
                "steps_timed": timing.steps_timed,
                "measured_over_predicted_ratio": timing.median_seconds / prediction.seconds,
                # Modelled MBU and MFU: the predicted bytes and FLOPs over the measured time, ÷ the peaks.
                "modelled_memory_bandwidth_utilization": (
                    cost.bytes / timing.median_seconds / peaks.memory_bandwidth_bytes_per_second
                ),
                "modelled_compute_utilization": cost.flops / timing.median_seconds / peaks.flops_per_second,
                **timing.gpm,
            }
            rows.append(row)
            print(_row_line(row), flush=True)
    finally:
        if sampler is not None:
            sampler.close()

    result = {
        "device": device.type,
        "device_name": device_name,
        "driver_version": gpm.get("driver_version"),
        "cuda_version": torch.version.cuda,
        "torch_version": torch.__version__,
        "dtype": "bfloat16",
        "shape": asdict(shape),
        "layers_run": layers,
        "weight_bytes": weight_bytes,
        "l2_cache_bytes": l2_bytes,
        "peaks": asdict(peaks),
        "gpm": gpm,
        "settings": {
            "warmup": args.warmup,
            "repeats": args.repeats,
            "min_seconds": args.min_seconds,
            "steps_per_sync": STEPS_PER_SYNC,
        },
        "seconds_taken": time.monotonic() - started,
        "rows": rows,
    }
    output = args.output or default_output()
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {output} ({result['seconds_taken']:.0f} s)")
    return 0


def _row_line(row: Mapping[str, Any]) -> str:
    def ratio(value: float | None) -> str:
        return f"{value:6.1%}" if value is not None else "     –"

    return (
        f"{row['phase']:8} {row['tokens']:5d} {row['measured_seconds'] * 1e3:11.3f} "
        f"{row['predicted_seconds'] * 1e3:12.3f} {row['predicted_bound']:>7} "
        f"{ratio(row['modelled_memory_bandwidth_utilization'])} {ratio(row['modelled_compute_utilization'])} "
        f"{ratio(row['gpm_dram_bandwidth_utilization']):>8} {ratio(row['gpm_tensor_active']):>10}"
    )


if __name__ == "__main__":
    sys.exit(main())
