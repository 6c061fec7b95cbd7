"""Peak memory bandwidth and FLOP/s of the device a model runs on, its memory capacity, and where each
figure came from.

Every figure that divides by a peak says which source the peak has:
"datasheet" (the table below), "measured" (phasescope.telemetry.hardware.probe on this machine)
or "flag" (given by the operator). Datasheet FLOP/s are dense (no 2:4
sparsity), per device. A dtype is judged only against its own family's
figure: a device without one has no peak for it, never a neighbour's. Memory
capacity is the datasheet's figure read as GiB: the datasheets print "GB", but the
memory is binary — an "80 GB" H100 SXM reports 81,559 MiB (79.6 GiB, 85.5 × 10⁹
bytes) to NVML — so the table holds 80 × 2³⁰ bytes for it, within 0.5 % of that.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Literal

PeakSource = Literal["datasheet", "measured", "flag"]

TERA = 1e12

FAMILIES = ("bf16", "fp16", "fp8", "tf32", "fp32")
"""Dtype families a datasheet row can carry: tensor-core BF16, FP16, FP8, TF32; "fp32" is non-tensor FP32."""


class NoPeakFlopsError(ValueError):
    """The device's peaks have no FLOP/s figure for the dtype's family; `--peak-flops` supplies one."""


@dataclass(frozen=True, slots=True)
class HardwarePeaks:
    device: str
    """Canonical key (e.g. "h100-sxm", "h100-sxm mig 3g.40gb") or a description of a measured device."""
    memory_bandwidth_bytes_per_second: float
    flops_per_second: dict[str, float] = field(default_factory=dict)
    """Dense peak FLOP/s by dtype family (`FAMILIES`); a measured device has only the family it measured."""
    source: PeakSource = "datasheet"
    description: str = ""
    memory_bytes: float | None = None
    """The device's memory capacity in bytes (None: unknown, e.g. a measured device not told its budget)."""

    def has_flops(self, dtype: str) -> bool:
        return dtype_family(dtype) in self.flops_per_second

    def peak_flops(self, dtype: str) -> float:
        """Peak FLOP/s of the dtype's own family; NoPeakFlopsError when the device has no figure for it."""
        family = dtype_family(dtype)
        if family not in self.flops_per_second:
            known = ", ".join(self.flops_per_second) or "none"
            raise NoPeakFlopsError(
                f"{self.description or self.device} has no peak FLOP/s for {dtype} ({family}; it has: {known}); "
                "give one with --peak-flops"
            )
        return self.flops_per_second[family]

    def ridge_point_flops_per_byte(self, dtype: str) -> float:
        # Ridge point = peak FLOP/s ÷ peak bytes/s: the arithmetic intensity at
        # which a kernel stops being bandwidth-bound and becomes compute-bound.
        return self.peak_flops(dtype) / self.memory_bandwidth_bytes_per_second

    def shared_by(self, engines: int) -> HardwarePeaks:
        """What each of `engines` engine cores sharing this one device (a CPU's cores and memory)
        is judged against: an equal share, so that per-engine utilisations add up to the device's."""
        if engines <= 1:
            return self
        return self.scaled(memory_share=1 / engines, compute_share=1 / engines)

    def scaled(self, memory_share: float, compute_share: float) -> HardwarePeaks:
        """A part of this device: `memory_share` of its bandwidth and `compute_share` of every FLOP/s figure."""
        return replace(
            self,
            memory_bandwidth_bytes_per_second=self.memory_bandwidth_bytes_per_second * memory_share,
            flops_per_second={family: flops * compute_share for family, flops in self.flops_per_second.items()},
            # A share of the memory slices is the same share of the capacity (a MIG slice's, a CPU engine's).
            memory_bytes=self.memory_bytes * memory_share if self.memory_bytes is not None else None,
        )

    def with_overrides(
        self,
        memory_bandwidth_bytes_per_second: float | None = None,
        flops_per_second: float | None = None,
        memory_bytes: float | None = None,
    ) -> HardwarePeaks:
        """Operator-given peaks win over the datasheet and the probe; the source becomes "flag".

        `--peak-flops` is the served dtype's figure: it is set for every family, so the
        served dtype finds it whatever its family.
        """
        # The capacity is a fact the operator states; alone, it does not make the peaks "flag".
        peaks = self if memory_bytes is None else replace(self, memory_bytes=memory_bytes)
        if memory_bandwidth_bytes_per_second is None and flops_per_second is None:
            return peaks
        flops = dict(peaks.flops_per_second)
        if flops_per_second is not None:
            flops = dict.fromkeys((*FAMILIES, *peaks.flops_per_second), flops_per_second)
        return replace(
            peaks,
            memory_bandwidth_bytes_per_second=memory_bandwidth_bytes_per_second
            or peaks.memory_bandwidth_bytes_per_second,
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
    if name in {"tf32", "tensorfloat32"}:
        return "tf32"
    if name in {"float32", "float", "fp32"}:
        return "fp32"
    return name


GIB = 2**30


def _gpu(
    bandwidth_tb: float,
    *,
    bf16: float,
    fp8: float | None,
    tf32: float | None,
    fp32: float | None,
    name: str,
    memory_gb: float,
) -> HardwarePeaks:
    """A datasheet row in the units datasheets print: TB/s, TFLOP/s and "GB" (binary: GiB); FP16 tensor
    throughput equals BF16's."""
    tflops = {"bf16": bf16, "fp16": bf16, "fp8": fp8, "tf32": tf32, "fp32": fp32}
    flops = {family: value * TERA for family, value in tflops.items() if value is not None}
    return HardwarePeaks("", bandwidth_tb * TERA, flops, "datasheet", name, memory_gb * GIB)


# Datasheet peaks: HBM/GDDR bytes/s; dense tensor FLOP/s (half the "with sparsity" figure) for BF16/FP16,
# FP8 and TF32; non-tensor FP32. A family the part lacks (FP8 before Hopper and Ada) is left out.
DATASHEET: dict[str, HardwarePeaks] = {
    # NVIDIA H100 Tensor Core GPU datasheet, SXM5 80 GB: 3.35 TB/s HBM3; FP32 67 TFLOPS;
    # TF32 989, BF16 1,979 and FP8 3,958 TFLOPS with sparsity.
    "h100-sxm": _gpu(3.35, bf16=989, fp8=1979, tf32=494.5, fp32=67, name="NVIDIA H100 SXM5 80GB", memory_gb=80),
    # Same datasheet, PCIe 80 GB: 2 TB/s HBM2e; FP32 51 TFLOPS; TF32 756, BF16 1,513 and FP8 3,026 with sparsity.
    "h100-pcie": _gpu(2.0, bf16=756, fp8=1513, tf32=378, fp32=51, name="NVIDIA H100 PCIe 80GB", memory_gb=80),
    # Same datasheet, H100 NVL 94 GB: 3.9 TB/s; FP32 60 TFLOPS; TF32 835, BF16 1,671 and FP8 3,341 with sparsity.
    "h100-nvl": _gpu(3.9, bf16=835, fp8=1670, tf32=417.5, fp32=60, name="NVIDIA H100 NVL 94GB", memory_gb=94),
    # NVIDIA H200 Tensor Core GPU datasheet, SXM 141 GB: 4.8 TB/s HBM3e; FP32 67 TFLOPS;
    # TF32 989, BF16 1,979 and FP8 3,958 TFLOPS with sparsity.
    "h200": _gpu(4.8, bf16=989, fp8=1979, tf32=494.5, fp32=67, name="NVIDIA H200 141GB", memory_gb=141),
    # Same datasheet, H200 NVL 141 GB: 4.8 TB/s HBM3e; FP32 60 TFLOPS; TF32 835, BF16 1,671 and FP8 3,341 with
    # sparsity (halved as the H100 NVL row). Not verified online: the search found no copy of the NVL column.
    "h200-nvl": _gpu(4.8, bf16=835, fp8=1670, tf32=417.5, fp32=60, name="NVIDIA H200 NVL 141GB", memory_gb=141),
    # NVIDIA GH200 Grace Hopper Superchip datasheet, 96 GB HBM3: 4 TB/s; FP32 67 TFLOPS; TF32 989, BF16 1,979 and
    # FP8 3,958 TFLOPS with sparsity (the H100 SXM's GH100 compute, halved as that row). Not verified online: the
    # search found no copy of the datasheet.
    "gh200-96gb": _gpu(4.0, bf16=989, fp8=1979, tf32=494.5, fp32=67, name="NVIDIA GH200 96GB HBM3", memory_gb=96),
    # Same datasheet, 144 GB HBM3e: 4.9 TB/s; compute as the 96 GB part. Not verified online.
    "gh200-144gb": _gpu(4.9, bf16=989, fp8=1979, tf32=494.5, fp32=67, name="NVIDIA GH200 144GB HBM3e", memory_gb=144),
    # NVIDIA publishes no public H20 datasheet. Third-party copies of NVIDIA's partner specifications give
    # 96 GB HBM3 at 4.0 TB/s; FP32 44, TF32 74, BF16 148 and FP8 296 TFLOPS dense. Not verified against NVIDIA.
    "h20": _gpu(4.0, bf16=148, fp8=296, tf32=74, fp32=44, name="NVIDIA H20 96GB", memory_gb=96),
    # NVIDIA A100 Tensor Core GPU datasheet, 40 GB SXM: 1,555 GB/s HBM2; FP32 19.5 TFLOPS; TF32 156 and
    # BF16 312 TFLOPS dense; no FP8.
    "a100-40gb": _gpu(1.555, bf16=312, fp8=None, tf32=156, fp32=19.5, name="NVIDIA A100 40GB", memory_gb=40),
    # Same datasheet, 80 GB SXM: 2,039 GB/s HBM2e; compute as the 40 GB part.
    "a100-80gb": _gpu(2.039, bf16=312, fp8=None, tf32=156, fp32=19.5, name="NVIDIA A100 80GB", memory_gb=80),
    # Same datasheet, 80 GB PCIe: 1,935 GB/s HBM2e; compute as the SXM parts.
    "a100-80gb-pcie": _gpu(1.935, bf16=312, fp8=None, tf32=156, fp32=19.5, name="NVIDIA A100 80GB PCIe", memory_gb=80),
    # NVIDIA L4 datasheet: 300 GB/s GDDR6; FP32 30.3 TFLOPS; TF32 120, BF16 242 and FP8 485 TFLOPS with sparsity.
    "l4": _gpu(0.300, bf16=121, fp8=242.5, tf32=60, fp32=30.3, name="NVIDIA L4", memory_gb=24),
    # NVIDIA L40 datasheet: 864 GB/s GDDR6; FP32 90.5 TFLOPS; dense TF32 90.5, BF16 181.05 and FP8 362 TFLOPS
    # (181, 362.1 and 724 with sparsity).
    "l40": _gpu(0.864, bf16=181.05, fp8=362, tf32=90.5, fp32=90.5, name="NVIDIA L40", memory_gb=48),
    # NVIDIA L40S datasheet: 864 GB/s GDDR6; FP32 91.6 TFLOPS; dense TF32 183, BF16 362.05 and FP8 733 TFLOPS
    # (366, 733 and 1,466 with sparsity).
    "l40s": _gpu(0.864, bf16=362.05, fp8=733, tf32=183, fp32=91.6, name="NVIDIA L40S", memory_gb=48),
    # NVIDIA RTX 6000 Ada Generation datasheet: 960 GB/s GDDR6; FP32 91.1 TFLOPS; 1,457 TFLOPS FP8 with sparsity.
    # The datasheet prints no BF16 or TF32 figure: 364.2 and 182.1 dense are the Ada Lovelace architecture
    # whitepaper's RTX 6000 column (FP32 accumulate), not verified online.
    "rtx-6000-ada": _gpu(
        0.960, bf16=364.2, fp8=728.5, tf32=182.1, fp32=91.1, name="NVIDIA RTX 6000 Ada Generation", memory_gb=48
    ),
    # NVIDIA A10 datasheet: 600 GB/s GDDR6; FP32 31.2 TFLOPS; dense TF32 62.5 and BF16 125 TFLOPS.
    "a10": _gpu(0.600, bf16=125, fp8=None, tf32=62.5, fp32=31.2, name="NVIDIA A10", memory_gb=24),
    # AWS A10G (G5 instances): same 600 GB/s GDDR6 as the A10, ~70 TFLOPS dense BF16 tensor throughput as AWS and
    # third-party comparisons give it. NVIDIA publishes no A10G datasheet, so no FP32 or TF32 figure is given:
    # those dtypes are measured or given with --peak-flops.
    "a10g": _gpu(0.600, bf16=70, fp8=None, tf32=None, fp32=None, name="NVIDIA A10G", memory_gb=24),
    # NVIDIA HGX B200 specifications, per GPU: 8 TB/s HBM3e; FP32 75 TFLOPS; TF32 2.2, BF16 4.5 and FP8 9 PFLOPS
    # with sparsity. (NVIDIA's current HGX page prints 7.7 TB/s beside 180 GB; DGX B200's 64 TB/s ÷ 8 is 8 TB/s.)
    "b200": _gpu(8.0, bf16=2250, fp8=4500, tf32=1100, fp32=75, name="NVIDIA B200", memory_gb=180),
    # NVIDIA GB200 NVL72 specifications, per Blackwell GPU: 186 GB HBM3e, 8 TB/s; FP32 80 TFLOPS; TF32 2.5,
    # BF16 5 and FP8 10 PFLOPS with sparsity. (An earlier GB200 sheet gave 180 TFLOPS FP32 per two-GPU superchip.)
    "gb200": _gpu(8.0, bf16=2500, fp8=5000, tf32=1250, fp32=80, name="NVIDIA GB200 (per GPU)", memory_gb=186),
    # AMD Instinct MI300X datasheet: 5.3 TB/s HBM3; FP32 vector 163.4 TFLOPS; TF32 653.7, BF16 1,307.4 and
    # FP8 2,614.9 TFLOPS dense.
    "mi300x": _gpu(5.3, bf16=1307.4, fp8=2614.9, tf32=653.7, fp32=163.4, name="AMD Instinct MI300X", memory_gb=192),
    # AMD Instinct MI325X specifications: 6 TB/s HBM3E; FP32 vector 163.4 TFLOPS; TF32 653.7, BF16 1,307.4 and
    # FP8 2,614.9 TFLOPS dense (the MI300X's CDNA 3 compute).
    "mi325x": _gpu(6.0, bf16=1307.4, fp8=2614.9, tf32=653.7, fp32=163.4, name="AMD Instinct MI325X", memory_gb=256),
}
DATASHEET = {key: replace(peaks, device=key) for key, peaks in DATASHEET.items()}

# Device-name patterns (as NVML, torch.cuda or ROCm report them) to table keys, most specific first:
# "gh200" and "gb200" contain "h200" and "b200", an NVL or PCIe name contains the bare model's.
_NAME_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"gh200.*(144|hbm3e)", "gh200-144gb"),
    (r"gh200", "gh200-96gb"),
    (r"gb200", "gb200"),
    (r"h100.*nvl", "h100-nvl"),
    (r"h100.*pcie", "h100-pcie"),
    (r"h100", "h100-sxm"),
    (r"h200.*nvl", "h200-nvl"),
    (r"h200", "h200"),
    (r"\bh20\b", "h20"),
    (r"a100.*80.*pcie|a100.*pcie.*80", "a100-80gb-pcie"),
    (r"a100.*80", "a100-80gb"),
    (r"a100", "a100-40gb"),
    (r"l40s", "l40s"),
    (r"\bl40\b", "l40"),
    (r"\bl4\b", "l4"),
    (r"a10g", "a10g"),
    (r"\ba10\b", "a10"),
    (r"rtx.?6000.*ada", "rtx-6000-ada"),
    (r"b200", "b200"),
    (r"mi325x", "mi325x"),
    (r"mi300x", "mi300x"),
)

# GPUs that split into MIG slices, with their memory in GB (datasheet capacity). Each has 7 compute
# slices and 8 memory slices: a GPU instance "3g.40gb" holds 3 of the 7 compute slices and as many
# eighths of the memory, and so of its bandwidth, as 40 GB is of the whole (4 of 8 on an 80 GB GPU).
_MIG_MEMORY_GB: dict[str, float] = {
    "a100-40gb": 40,
    "a100-80gb": 80,
    "a100-80gb-pcie": 80,
    "h100-sxm": 80,
    "h100-pcie": 80,
    "h100-nvl": 94,
    "h200": 141,
    "h200-nvl": 141,
    "gh200-96gb": 96,
    "gh200-144gb": 144,
    "h20": 96,
    "b200": 180,
    "gb200": 186,
}
_MIG_COMPUTE_SLICES = 7
_MIG_MEMORY_SLICES = 8

# NVML names a MIG device "<parent name> MIG <profile>": a GPU instance "3g.40gb" (optionally "+me" and the
# like), or a compute instance inside one, "1c.3g.40gb" (1 of the instance's 3 compute slices).
_MIG_NAME = re.compile(
    r"^(?P<parent>.+?)\s+mig\s+(?P<profile>(?:(?P<compute>\d+)c\.)?(?P<slices>\d+)g\.(?P<gb>\d+)gb(?:[+-][\w.]+)?)$"
)


def lookup_device(name: str) -> HardwarePeaks | None:
    """Datasheet peaks for a device name ("NVIDIA H100 80GB HBM3", "h100-sxm", "... MIG 1g.10gb"); None when unknown.

    A MIG slice gets its parent's row scaled by the slice's share; a MIG name whose parent or profile
    cannot be understood is unknown, never the whole GPU.
    """
    key = name.strip().lower()
    if names_mig_slice(key):
        return _lookup_mig(key)
    return _lookup_whole(key)


def names_mig_slice(name: str) -> bool:
    """Whether a device name is a MIG slice's ("NVIDIA H100 80GB HBM3 MIG 1g.10gb"), understood or not."""
    return re.search(r"\bmig\b", name, re.IGNORECASE) is not None


def _lookup_whole(key: str) -> HardwarePeaks | None:
    if key in DATASHEET:
        return DATASHEET[key]
    for pattern, table_key in _NAME_PATTERNS:
        if re.search(pattern, key):
            return DATASHEET[table_key]
    return None


def _lookup_mig(key: str) -> HardwarePeaks | None:
    match = _MIG_NAME.match(key)
    if match is None:
        return None
    parent = _lookup_whole(match["parent"])
    if parent is None or parent.device not in _MIG_MEMORY_GB:
        return None
    slices = int(match["slices"])
    compute = int(match["compute"]) if match["compute"] else slices
    if not 1 <= compute <= slices <= _MIG_COMPUTE_SLICES:
        return None
    # Memory slices = the profile's GB ÷ the parent's GB, in eighths: 1g.10gb of 80 GB is 1/8, 3g.40gb is 4/8.
    eighths = int(match["gb"]) / _MIG_MEMORY_GB[parent.device] * _MIG_MEMORY_SLICES
    memory = round(eighths)
    if not 1 <= memory <= _MIG_MEMORY_SLICES or abs(eighths - memory) > 0.25:
        return None  # a profile this parent does not have
    profile = match["profile"]
    slice_peaks = parent.scaled(memory_share=memory / _MIG_MEMORY_SLICES, compute_share=compute / _MIG_COMPUTE_SLICES)
    return replace(
        slice_peaks,
        device=f"{parent.device} mig {profile}",
        description=f"{parent.description}, MIG {profile} ({compute}/{_MIG_COMPUTE_SLICES} of the compute, "
        f"{memory}/{_MIG_MEMORY_SLICES} of the memory bandwidth)",
    )
