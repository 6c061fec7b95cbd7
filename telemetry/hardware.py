"""Peak memory bandwidth and FLOP/s of the device a model runs on, and where each figure came from.

Every figure that divides by a peak says which source the peak has:
"datasheet" (the table below), "measured" (telemetry.probe on this machine)
or "flag" (given by the operator). Datasheet FLOP/s are dense (no 2:4
sparsity), per device.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Literal

PeakSource = Literal["datasheet", "measured", "flag"]

TERA = 1e12


@dataclass(frozen=True, slots=True)
class HardwarePeaks:
    device: str
    """Canonical key (e.g. "h100-sxm") or a description of a measured device."""
    memory_bandwidth_bytes_per_second: float
    flops_per_second: dict[str, float] = field(default_factory=dict)
    """Dense peak FLOP/s by dtype family: "bf16", "fp16", "fp8", "fp32"."""
    source: PeakSource = "datasheet"
    description: str = ""

    def peak_flops(self, dtype: str) -> float:
        """Peak FLOP/s for the served dtype; falls back to the closest family the table has."""
        family = dtype_family(dtype)
        for candidate in (family, "bf16", "fp16", "fp32"):
            if candidate in self.flops_per_second:
                return self.flops_per_second[candidate]
        raise KeyError(f"no FLOP/s figure for {dtype} on {self.device}")

    def ridge_point_flops_per_byte(self, dtype: str) -> float:
        # Ridge point = peak FLOP/s ÷ peak bytes/s: the arithmetic intensity at
        # which a kernel stops being bandwidth-bound and becomes compute-bound.
        return self.peak_flops(dtype) / self.memory_bandwidth_bytes_per_second

    def shared_by(self, engines: int) -> HardwarePeaks:
        """What each of `engines` engine cores sharing this one device (a CPU's cores and memory)
        is judged against: an equal share, so that per-engine utilisations add up to the device's."""
        if engines <= 1:
            return self
        return replace(
            self,
            memory_bandwidth_bytes_per_second=self.memory_bandwidth_bytes_per_second / engines,
            flops_per_second={family: flops / engines for family, flops in self.flops_per_second.items()},
        )

    def with_overrides(
        self, memory_bandwidth_bytes_per_second: float | None = None, flops_per_second: float | None = None
    ) -> HardwarePeaks:
        """Operator-given peaks win over the datasheet and the probe; the source becomes "flag"."""
        if memory_bandwidth_bytes_per_second is None and flops_per_second is None:
            return self
        flops = dict(self.flops_per_second)
        if flops_per_second is not None:
            flops = dict.fromkeys(("bf16", "fp16", "fp8", "fp32"), flops_per_second)
        return replace(
            self,
            memory_bandwidth_bytes_per_second=memory_bandwidth_bytes_per_second
            or self.memory_bandwidth_bytes_per_second,
            flops_per_second=flops,
            source="flag",
        )


def dtype_family(dtype: str) -> str:
    name = dtype.removeprefix("torch.").lower()
    if name in {"bfloat16", "bf16"}:
        return "bf16"
    if name in {"float16", "half", "fp16"}:
        return "fp16"
    if "8" in name and ("float8" in name or "fp8" in name):
        return "fp8"
    if name in {"float32", "float", "fp32"}:
        return "fp32"
    return name


def _gpu(bandwidth_tb: float, bf16_tflops: float, fp8_tflops: float | None, description: str) -> HardwarePeaks:
    flops = {"bf16": bf16_tflops * TERA, "fp16": bf16_tflops * TERA}
    if fp8_tflops is not None:
        flops["fp8"] = fp8_tflops * TERA
    return HardwarePeaks("", bandwidth_tb * TERA, flops, "datasheet", description)


# Datasheet peaks: HBM/GDDR bytes/s and dense tensor FLOP/s (half the sparse figure).
DATASHEET: dict[str, HardwarePeaks] = {
    # NVIDIA H100 Tensor Core GPU datasheet, SXM5 80 GB: 3.35 TB/s HBM3;
    # BF16 1,979 TFLOPS and FP8 3,958 TFLOPS with sparsity.
    "h100-sxm": _gpu(3.35, 989, 1979, "NVIDIA H100 SXM5 80GB"),
    # Same datasheet, PCIe 80 GB: 2 TB/s HBM2e; BF16 1,513 and FP8 3,026 TFLOPS with sparsity.
    "h100-pcie": _gpu(2.0, 756, 1513, "NVIDIA H100 PCIe 80GB"),
    # Same datasheet, H100 NVL 94 GB: 3.9 TB/s; BF16 1,671 and FP8 3,341 TFLOPS with sparsity.
    "h100-nvl": _gpu(3.9, 835, 1670, "NVIDIA H100 NVL 94GB"),
    # NVIDIA H200 Tensor Core GPU datasheet, SXM 141 GB: 4.8 TB/s HBM3e; BF16 1,979 and FP8 3,958 TFLOPS with sparsity.
    "h200": _gpu(4.8, 989, 1979, "NVIDIA H200 141GB"),
    # NVIDIA A100 Tensor Core GPU datasheet, 40 GB SXM: 1,555 GB/s HBM2; BF16 312 TFLOPS dense; no FP8.
    "a100-40gb": _gpu(1.555, 312, None, "NVIDIA A100 40GB"),
    # Same datasheet, 80 GB SXM: 2,039 GB/s HBM2e; BF16 312 TFLOPS dense.
    "a100-80gb": _gpu(2.039, 312, None, "NVIDIA A100 80GB"),
    # NVIDIA L4 datasheet: 300 GB/s GDDR6; BF16 242 and FP8 485 TFLOPS with sparsity.
    "l4": _gpu(0.300, 121, 242.5, "NVIDIA L4"),
    # NVIDIA L40S datasheet: 864 GB/s GDDR6; BF16 733 and FP8 1,466 TFLOPS with sparsity.
    "l40s": _gpu(0.864, 362.05, 733, "NVIDIA L40S"),
    # NVIDIA A10 datasheet: 600 GB/s GDDR6; BF16 125 TFLOPS dense (A10G's differences are in tensor throughput).
    "a10": _gpu(0.600, 125, None, "NVIDIA A10"),
    # AWS A10G (G5 instances): same 600 GB/s GDDR6 as the A10, ~70 TFLOPS dense BF16 tensor throughput as AWS and
    # third-party comparisons give it (NVIDIA publishes no A10G datasheet).
    "a10g": _gpu(0.600, 70, None, "NVIDIA A10G"),
    # NVIDIA HGX B200 specifications, per GPU: 8 TB/s HBM3e; FP8 9 PFLOPS and BF16 4.5 PFLOPS with sparsity.
    "b200": _gpu(8.0, 2250, 4500, "NVIDIA B200"),
    # AMD Instinct MI300X datasheet: 5.3 TB/s HBM3; BF16 1,307.4 TFLOPS and FP8 2,614.9 TFLOPS dense.
    "mi300x": _gpu(5.3, 1307.4, 2614.9, "AMD Instinct MI300X"),
}
DATASHEET = {key: replace(peaks, device=key) for key, peaks in DATASHEET.items()}

# Device-name patterns (as NVML, torch.cuda or ROCm report them) to table keys, most specific first.
_NAME_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"h100.*nvl", "h100-nvl"),
    (r"h100.*pcie", "h100-pcie"),
    (r"h100", "h100-sxm"),
    (r"h200", "h200"),
    (r"a100.*80", "a100-80gb"),
    (r"a100", "a100-40gb"),
    (r"l40s", "l40s"),
    (r"\bl4\b", "l4"),
    (r"a10g", "a10g"),
    (r"\ba10\b", "a10"),
    (r"b200", "b200"),
    (r"mi300x", "mi300x"),
)


def lookup_device(name: str) -> HardwarePeaks | None:
    """Datasheet peaks for a device name ("NVIDIA H100 80GB HBM3", "h100-sxm", ...); None when unknown."""
    key = name.strip().lower()
    if key in DATASHEET:
        return DATASHEET[key]
    for pattern, table_key in _NAME_PATTERNS:
        if re.search(pattern, key):
            return DATASHEET[table_key]
    return None
