import os

import pytest

from server.config import Settings
from server.peaks import engine_threads


def test_explicit_mask_counts_one_ranks_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-3,8|4-7,9")
    assert engine_threads() == 5


def test_nobind_uses_every_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    assert engine_threads() == len(os.sched_getaffinity(0))


def test_auto_keeps_cores_for_the_scheduler(monkeypatch: pytest.MonkeyPatch) -> None:
    # vllm-cpu reserves one core per local worker; what is left computes, at least one thread.
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    cpus = len(os.sched_getaffinity(0))
    assert 1 <= engine_threads() <= max(1, cpus - 1)
    auto = engine_threads(Settings())
    # Reserving nothing leaves one more core to compute with (vLLM warns but obeys).
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    assert engine_threads(Settings()) >= auto
