"""Measured peaks for devices without a datasheet row: a CPU (always) or a GPU (on request).

Two short measurements with PyTorch, on the threads the engine will use:
- sustained memory bandwidth: a STREAM-style triad `a = b + s × c` over arrays
  far larger than the caches; bytes moved = 3 × array bytes per pass (two
  reads, one write), best of several passes;
- matmul FLOP/s in the served dtype: square matmuls, 2 × n³ FLOPs each.

The result is cached on disk under the machine's identity (CPU model, core
count, threads, dtype, device, torch version), so it runs once per machine.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from telemetry.hardware import HardwarePeaks, dtype_family

logger = logging.getLogger(__name__)

_PROBE_VERSION = 1


@dataclass(frozen=True, slots=True)
class ProbeResult:
    device: str
    dtype: str
    threads: int
    memory_bandwidth_bytes_per_second: float
    matmul_flops_per_second: float
    seconds_taken: float

    def peaks(self) -> HardwarePeaks:
        return HardwarePeaks(
            device=self.device,
            memory_bandwidth_bytes_per_second=self.memory_bandwidth_bytes_per_second,
            flops_per_second={dtype_family(self.dtype): self.matmul_flops_per_second},
            source="measured",
            description=self.device,
        )


def _cpuinfo() -> list[dict[str, str]]:
    """One record per logical CPU from /proc/cpuinfo; empty where there is none."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    records = []
    for block in text.strip().split("\n\n"):
        fields = (line.partition(":") for line in block.splitlines())
        records.append({key.strip(): value.strip() for key, _, value in fields})
    return records


def cpu_name() -> str:
    for record in _cpuinfo():
        if "model name" in record:
            return record["model name"]
    return platform.processor() or platform.machine()


def physical_cores(cpus: set[int]) -> int:
    """Distinct (package, core) pairs among the logical CPUs `cpus`: SMT siblings count once."""
    cores = {
        (record.get("physical id", ""), record["core id"])
        for record in _cpuinfo()
        if record.get("processor", "").isdigit() and int(record["processor"]) in cpus and "core id" in record
    }
    return len(cores) or len(cpus)


def _identity(device: str, dtype: str, threads: int) -> dict[str, Any]:
    import torch

    return {
        "probe_version": _PROBE_VERSION,
        "device": device,
        "dtype": dtype,
        "threads": threads,
        "cpu": cpu_name(),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "torch": torch.__version__,
    }


def _cache_file(cache_dir: Path, identity: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir / "hardware" / f"probe-{digest}.json"


def measure(
    device: str = "cpu", dtype: str = "float32", threads: int | None = None, array_mib: int = 256
) -> ProbeResult:
    """Run the probe now (a few seconds)."""
    import torch

    started = time.monotonic()
    threads = threads or torch.get_num_threads()
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch_device = torch.device("cuda" if device.startswith("cuda") else "cpu")

        def sync() -> None:
            if torch_device.type == "cuda":
                torch.cuda.synchronize()

        elements = array_mib * 2**20 // 4
        a = torch.empty(elements, dtype=torch.float32, device=torch_device)
        b = torch.ones(elements, dtype=torch.float32, device=torch_device)
        c = torch.ones(elements, dtype=torch.float32, device=torch_device)
        best_triad = float("inf")
        for _ in range(6):
            sync()
            begin = time.perf_counter()
            torch.add(b, c, alpha=3.0, out=a)
            sync()
            best_triad = min(best_triad, time.perf_counter() - begin)
        # Triad moves 3 × array bytes: b and c read, a written.
        bandwidth = 3 * elements * 4 / best_triad
        del a, b, c

        matmul_dtype = getattr(torch, dtype.removeprefix("torch."))
        size = 1024 if torch_device.type == "cpu" else 8192
        x = torch.randn(size, size, device=torch_device).to(matmul_dtype)
        y = torch.randn(size, size, device=torch_device).to(matmul_dtype)
        torch.matmul(x, y)  # warm-up: kernel selection, page faults
        best_matmul = float("inf")
        for _ in range(5):
            sync()
            begin = time.perf_counter()
            torch.matmul(x, y)
            sync()
            best_matmul = min(best_matmul, time.perf_counter() - begin)
        # A square matmul does n³ multiply-adds: 2 × n³ FLOPs.
        flops = 2 * size**3 / best_matmul
    finally:
        torch.set_num_threads(previous_threads)
    name = cpu_name() if torch_device.type == "cpu" else torch.cuda.get_device_name(0)
    return ProbeResult(
        device=f"{torch_device.type}: {name}",
        dtype=dtype.removeprefix("torch."),
        threads=threads,
        memory_bandwidth_bytes_per_second=bandwidth,
        matmul_flops_per_second=flops,
        seconds_taken=time.monotonic() - started,
    )


def cached_measure(
    cache_dir: Path, device: str = "cpu", dtype: str = "float32", threads: int | None = None, refresh: bool = False
) -> tuple[ProbeResult, bool]:
    """The probe's result for this machine, measured once and then read from the cache; (result, from_cache)."""
    import torch

    threads = threads or torch.get_num_threads()
    identity = _identity(device, dtype.removeprefix("torch."), threads)
    path = _cache_file(cache_dir, identity)
    if not refresh and path.is_file():
        try:
            stored = json.loads(path.read_text())
            if stored.get("identity") == identity:
                return ProbeResult(**stored["result"]), True
        except (OSError, ValueError, TypeError, KeyError):
            logger.warning("ignoring an unreadable hardware probe cache at %s", path)
    logger.info("measuring %s peaks (memory bandwidth and %s matmul FLOP/s, a few seconds, once)", device, dtype)
    result = measure(device, dtype, threads)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps({"identity": identity, "result": _as_dict(result)}))
    temporary.replace(path)
    return result, False


def _as_dict(result: ProbeResult) -> dict[str, Any]:
    return {name: getattr(result, name) for name in result.__dataclass_fields__}
