"""The CPU build's seeded-sampling remedy against vLLM's own classes (phasescope.engine.vllm.cpu_sampling).

The end-to-end proof (seeded requests with chunked prompts served on the real engine, both protocols) is
tests/integration/test_engine_survives.py; this file pins the vLLM internals the remedy relies on, so a
vLLM upgrade that moves them fails here by name.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from phasescope.engine.vllm import cpu_sampling
from phasescope.engine.vllm.engine import CPU_SEEDED_SAMPLING


def test_vllm_still_rewinds_discarded_seeded_samples_by_an_offset_the_cpu_generator_lacks() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    bookkeeping = inspect.getsource(GPUModelRunner._bookkeeping_sync)
    assert "discard_request_mask" in bookkeeping
    assert "input_batch.generators.get" in bookkeeping
    assert "set_offset(gen.get_offset()" in bookkeeping
    # The defect itself: PyTorch's CPU generator has no offset to rewind.
    with pytest.raises(RuntimeError, match="CPU Generator does not use offset"):
        torch.Generator(device="cpu").get_offset()
    # The step samples and books in `sample_tokens`, after `execute_model` prepared the discard mask.
    assert "_bookkeeping_sync(" in inspect.getsource(GPUModelRunner.sample_tokens)
    assert "discard_request_mask" in inspect.getsource(GPUModelRunner._prepare_inputs)


def test_the_engine_names_a_worker_extension_vllm_can_load() -> None:
    from vllm.utils.import_utils import resolve_obj_by_qualname

    assert resolve_obj_by_qualname(CPU_SEEDED_SAMPLING) is cpu_sampling.SeededSamplingOnCpu
    # vLLM refuses an extension whose attributes clash with the worker's: this one adds none.
    assert not [name for name in vars(cpu_sampling.SeededSamplingOnCpu) if not name.startswith("__")]


def test_the_cpu_runner_is_wrapped_once() -> None:
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    assert cpu_sampling.install()
    wrapped = CPUModelRunner.sample_tokens
    assert getattr(wrapped, "keeps_seeded_streams", False)
    assert cpu_sampling.install()
    assert CPUModelRunner.sample_tokens is wrapped


def fake_runner(generators: dict[int, torch.Generator], discard: list[bool]) -> Any:
    return SimpleNamespace(
        input_batch=SimpleNamespace(generators=generators, num_reqs=len(discard)),
        discard_request_mask=SimpleNamespace(np=np.array([*discard, False, False])),
        execute_model_state=object(),
    )


def test_a_discarded_row_samples_without_its_generator_which_is_back_for_the_next_step() -> None:
    partial, whole = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    runner = fake_runner({0: partial, 2: whole}, [True, False, False])
    seen: list[dict[int, torch.Generator]] = []

    def sample_tokens(runner: Any, grammar_output: object) -> str:
        # vLLM's sampler and bookkeeping see the batch's generators as they are now.
        seen.append(dict(runner.input_batch.generators))
        return "output"

    assert cpu_sampling.keep_seeded_streams(sample_tokens)(runner, None) == "output"
    assert seen == [{2: whole}]
    assert runner.input_batch.generators == {0: partial, 2: whole}


def test_a_seeded_stream_is_the_same_however_many_steps_discarded_a_sample() -> None:
    # What CUDA's rewind guarantees, on the CPU: each kept token draws the same number from the seeded stream.
    def draws(discarded_steps: int) -> list[int]:
        generator = torch.Generator().manual_seed(1)
        kept: list[int] = []

        def sample_tokens(runner: Any, grammar_output: object) -> None:
            row = runner.input_batch.generators.get(0)
            value = int(torch.randint(0, 2**31, (1,), generator=row).item()) if row is not None else -1
            if not runner.discard_request_mask.np[0]:
                kept.append(value)

        step = cpu_sampling.keep_seeded_streams(sample_tokens)
        for discard in [True] * discarded_steps + [False] * 3:
            step(fake_runner({0: generator}, [discard]), None)
        return kept

    assert draws(0) == draws(1) == draws(5)


def test_a_failing_step_still_puts_the_generators_back() -> None:
    generator = torch.Generator().manual_seed(3)
    runner = fake_runner({0: generator}, [True])

    def sample_tokens(runner: Any, grammar_output: object) -> None:
        raise RuntimeError("the step failed")

    with pytest.raises(RuntimeError, match="the step failed"):
        cpu_sampling.keep_seeded_streams(sample_tokens)(runner, None)
    assert runner.input_batch.generators == {0: generator}
