"""Measured peaks for devices without a datasheet row: a CPU (always) or a GPU (on request).

Short measurements with PyTorch, on the threads the engine will use:
- peak memory bandwidth, read: the faster of two read-only kernels over an
  array at least twice the last-level cache, a sum and a matrix-vector product
  (the array as a 16384-column matrix: decode's own weight-streaming kernel);
  bytes = array bytes per pass, best of several passes. Decode streams weights
  it only reads, so a read-only kernel is the roof it can reach; which of the
  two is faster depends on the machine (the sum scales with threads, a BLAS
  GEMV may not);
- for comparison, a STREAM-style triad `a = b + s × c` over arrays of the same
  size: 3 × array bytes per pass (two reads, one write). Its bytes are not the
  traffic a weight stream makes: a CPU write may read its line first
  (write-allocate, a 4th array's worth uncounted), and reads and writes
  together load the memory system differently from reads alone. It is
  reported, not used as the peak;
- matmul FLOP/s in the served dtype: square matmuls, 2 × n³ FLOPs each, with n
  growing as the cube root of the thread count so every thread has the same
  work however many there are.

Each measurement repeats until it has its passes or its time budget is spent,
so the probe takes seconds on a slow machine too. The result is cached on disk
under the machine's identity (CPU model, core count, threads, dtype, device,
torch version, probe version), so it runs once per machine, in a process of its
own: its arrays leave with it, not in the heap of the server that asked.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import json
import logging
import multiprocessing
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from phasescope.telemetry.hardware.peaks import HardwarePeaks, dtype_family

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# 2: the peak bandwidth is the faster read-only kernel's (1 was the triad's); the matmul grows with the threads.
_PROBE_VERSION = 2

_MIB = 2**20
_CPU_MATMUL_SIZE = 1024
"""Matmul side on one CPU thread: 2 GFLOP a product, tens of milliseconds on one core."""
_MAX_CPU_MATMUL_SIZE = 6144
"""Cap, reached at 216 threads: 144 MiB a float32 operand, three held."""
_GPU_MATMUL_SIZE = 8192
_MAX_ARRAY_BYTES = 1024 * _MIB
_GEMV_COLUMNS = 16384
"""Row length of the read GEMV: 64 KiB rows, so the output it writes is negligible."""
_BUDGET_SECONDS = 1.0
"""Time each measurement may take beyond its first two passes."""


@dataclass(frozen=True, slots=True)
class ProbeResult:
    device: str
    dtype: str
    threads: int
    memory_bandwidth_bytes_per_second: float
    """The peak: the faster read-only kernel's bytes/s."""
    sum_bandwidth_bytes_per_second: float
    """Read by a sum over the array: array bytes per pass."""
    gemv_bandwidth_bytes_per_second: float
    """Read by a matrix-vector product over the array as a matrix: array bytes per pass."""
    triad_bandwidth_bytes_per_second: float
    """The triad's bytes/s (3 × array bytes per pass), for comparison only."""
    array_bytes: int
    """Size of each array the bandwidth kernels stream."""
    matmul_flops_per_second: float
    matmul_size: int
    """n of the n × n matmuls."""
    seconds_taken: float

    def peaks(self) -> HardwarePeaks:
        return HardwarePeaks(
            device=self.device,
            memory_bandwidth_bytes_per_second=self.memory_bandwidth_bytes_per_second,
            # Keyed by the family measured: another dtype has no measured figure.
            flops_per_second={dtype_family(self.dtype): self.matmul_flops_per_second},
            source="measured",
            description=self.device,
        )


def parse_cpuinfo(text: str) -> tuple[dict[str, str], ...]:
    """One record per logical CPU of a /proc/cpuinfo text (blank-line separated `key : value` blocks)."""
    records = []
    for block in text.strip().split("\n\n"):
        fields = (line.partition(":") for line in block.splitlines())
        records.append({key.strip(): value.strip() for key, _, value in fields})
    return tuple(records)


@functools.cache
def _cpuinfo() -> tuple[dict[str, str], ...]:
    """/proc/cpuinfo's records, read once: the CPUs' model and cores do not change while a process runs."""
    try:
        return parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:  # not Linux
        return ()


def cpu_name() -> str:
    """The CPU's model name (`model name` in /proc/cpuinfo); the platform's processor or architecture elsewhere."""
    for record in _cpuinfo():
        if "model name" in record:
            return record["model name"]
    return platform.processor() or platform.machine()


def cpu_flags() -> frozenset[str]:
    """The first CPU's feature flags (x86's `flags` line: avx2, avx512f, amx_tile, ...); empty where none."""
    for record in _cpuinfo():
        if "flags" in record:
            return frozenset(record["flags"].split())
    return frozenset()


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


def last_level_cache_bytes() -> int:
    """The machine's last-level cache in bytes, every instance counted once; 0 where sysfs does not say."""
    instances: dict[str, int] = {}
    highest = 0
    for index in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/cache/index[0-9]*"):
        try:
            level = int((index / "level").read_text())
            shared = (index / "shared_cpu_list").read_text().strip()
            size = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        multiplier = {"K": 2**10, "M": 2**20, "G": 2**30}.get(size[-1:], 1)
        digits = size.rstrip("KMG")
        if not digits.isdigit() or level < highest:
            continue
        if level > highest:
            highest, instances = level, {}
        instances[shared] = int(digits) * multiplier
    return sum(instances.values())


def array_bytes_for(cache_bytes: int, array_mib: int) -> int:
    """Each bandwidth array: at least `array_mib`, and twice the last-level cache so a sequential
    pass never finds its data there, up to 1 GiB (the triad holds three); whole GEMV rows."""
    wanted = min(max(array_mib * _MIB, 2 * cache_bytes), max(array_mib * _MIB, _MAX_ARRAY_BYTES))
    row_bytes = 4 * _GEMV_COLUMNS
    return max(row_bytes, wanted // row_bytes * row_bytes)


def matmul_size_for(device_type: str, threads: int) -> int:
    """n of the probe's n × n matmul: on a CPU, n³ grows with the threads so each has the same work."""
    if device_type != "cpu":
        return _GPU_MATMUL_SIZE
    size: float = _CPU_MATMUL_SIZE * float(max(1, threads)) ** (1 / 3)
    return min(_MAX_CPU_MATMUL_SIZE, 128 * round(size / 128))


def _best_seconds(run: Callable[[], object], sync: Callable[[], None], passes: int) -> float:
    """Shortest time of `passes` runs, stopping early once `_BUDGET_SECONDS` is spent after the second."""
    best = float("inf")
    started = time.perf_counter()
    for done in range(passes):
        if done >= 2 and time.perf_counter() - started > _BUDGET_SECONDS:
            break
        sync()
        begin = time.perf_counter()
        run()
        sync()
        best = min(best, time.perf_counter() - begin)
    return best


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
        cache_bytes = last_level_cache_bytes() if torch_device.type == "cpu" else 0
        array_bytes = array_bytes_for(cache_bytes, array_mib)
        sum_bandwidth, gemv_bandwidth, triad_bandwidth = _bandwidths(torch_device, array_bytes)
        size = matmul_size_for(torch_device.type, threads)
        flops = _matmul_flops(torch_device, getattr(torch, dtype.removeprefix("torch.")), size)
    finally:
        torch.set_num_threads(previous_threads)
    name = cpu_name() if torch_device.type == "cpu" else torch.cuda.get_device_name(0)
    return ProbeResult(
        device=f"{torch_device.type}: {name}",
        dtype=dtype.removeprefix("torch."),
        threads=threads,
        memory_bandwidth_bytes_per_second=max(sum_bandwidth, gemv_bandwidth),
        sum_bandwidth_bytes_per_second=sum_bandwidth,
        gemv_bandwidth_bytes_per_second=gemv_bandwidth,
        triad_bandwidth_bytes_per_second=triad_bandwidth,
        array_bytes=array_bytes,
        matmul_flops_per_second=flops,
        matmul_size=size,
        seconds_taken=time.monotonic() - started,
    )


def _sync(device: torch.device) -> Callable[[], None]:
    import torch

    if device.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def _bandwidths(device: torch.device, array_bytes: int) -> tuple[float, float, float]:
    """(sum, GEMV, triad) bytes/s over float32 arrays of `array_bytes` each."""
    import torch

    elements = array_bytes // 4
    a = torch.empty(elements, dtype=torch.float32, device=device)
    b = torch.ones(elements, dtype=torch.float32, device=device)
    c = torch.ones(elements, dtype=torch.float32, device=device)
    matrix = b.view(-1, _GEMV_COLUMNS)
    vector = torch.ones(_GEMV_COLUMNS, dtype=torch.float32, device=device)
    rows = torch.empty(matrix.shape[0], dtype=torch.float32, device=device)
    sync = _sync(device)
    # Read: a sum reads every byte of b once and writes one number: bytes = array bytes.
    summed = elements * 4 / _best_seconds(lambda: torch.sum(b), sync, passes=8)
    # Read: b as a matrix times a vector reads every byte of b once; the vector and the
    # one number a row writes are 1/16384 of that: bytes = array bytes.
    gemv = elements * 4 / _best_seconds(lambda: torch.mv(matrix, vector, out=rows), sync, passes=8)
    # Triad moves 3 × array bytes: b and c read, a written.
    triad = 3 * elements * 4 / _best_seconds(lambda: torch.add(b, c, alpha=3.0, out=a), sync, passes=6)
    return summed, gemv, triad


def _matmul_flops(device: torch.device, dtype: torch.dtype, size: int) -> float:
    import torch

    x = torch.randn(size, size, device=device).to(dtype)
    y = torch.randn(size, size, device=device).to(dtype)
    product = torch.empty(size, size, device=device, dtype=dtype)
    torch.matmul(x, y, out=product)  # warm-up: kernel selection, page faults
    # A square matmul does n³ multiply-adds: 2 × n³ FLOPs.
    return 2 * size**3 / _best_seconds(lambda: torch.matmul(x, y, out=product), _sync(device), passes=5)


def measure_in_child(device: str = "cpu", dtype: str = "float32", threads: int | None = None) -> ProbeResult:
    """`measure` in a process of its own, so that its arrays (gigabytes) never stay in the caller's heap: an
    allocator keeps what it freed (tcmalloc, which `phasescope serve` preloads, kept 2.9 GB of a server's first
    start)."""
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no CUDA or thread state inherited
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context) as child:
        return child.submit(measure, device, dtype, threads).result()


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
    logger.info("measuring %s peaks (read bandwidth and %s matmul FLOP/s, a few seconds, once)", device, dtype)
    result = measure_in_child(device, dtype, threads)
    path.parent.mkdir(parents=True, exist_ok=True)
    # A temporary file of its own: servers started together on a fresh machine may each measure and store.
    temporary = path.with_suffix(f".{os.getpid()}.tmp")
    temporary.write_text(json.dumps({"identity": identity, "result": _as_dict(result)}))
    temporary.replace(path)
    return result, False


def _as_dict(result: ProbeResult) -> dict[str, Any]:
    return {name: getattr(result, name) for name in result.__dataclass_fields__}
