"""phasescope's KV connector: the connector given to --kv-transfer-config, wrapped so that no prompt takes the
engine down.

vLLM makes the connector in the engine core from `kv_connector_module_path`; `wrapped_kv_transfer_config` puts
the user's connector inside this one (vLLM's `MultiConnector` with that one child, which forwards every call).
What it adds: **no match below one block.** A connector's cache hit shorter than one whole KV block, or a count
below zero, is refused (0 tokens, nothing to load): vLLM allocates, loads and computes whole blocks. vLLM's
ExampleConnector, asked again for a prompt shorter than one block (128 tokens on CPU), answered a match of a
negative number of tokens, and the engine died with `IndexError: index out of range in self`
(docs/reliability.md). Such a prompt is computed, as it would be without a connector.

**Each request's transfer, timed.** The engine stamps no transfer: this connector times it where it happens and
hands the figures back with the request's last output, in its `kv_transfer_params` under `KV_TRANSFER_PARAMS_KEY`
(the front end takes them out before a client sees the parameters: `KvTransferFigures.from_params`).
- A load that runs inside a step (the ExampleConnector's: `start_load_kv` and `wait_for_layer_load`) is timed by
  the worker around those calls and reported to the scheduler with the step's output
  (`build_connector_worker_meta`); the step's load time is each request's that loaded in it.
- A load that runs apart from the steps (NIXL's: the request waits in WAITING_FOR_REMOTE_KVS) spans the scheduler
  pass that started it to the step whose workers report it received (`finished_recving`).
- A save (`save_kv_layer`, `wait_for_save`) is timed by the worker the same way; the step's save time is each
  request's whose prompt tokens the step computed. A connector that sends after the request has ended (NIXL's
  producer) is not in the request's figures: its answer has left by then.
The tokens are the match vLLM accepted (loaded) and the prompt tokens computed in saving steps (saved); the bytes
are those tokens times the KV cache's bytes per token (every layer's page ÷ the block size).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector, MultiKVConnectorMetadata

from phasescope.telemetry.request.phases import KV_TRANSFER_PARAMS_KEY

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

CONNECTOR_NAME = "PhasescopeConnector"
MODULE_PATH = __name__


@dataclass(slots=True)
class _Timer:
    """Time spent in one kind of KV move (load or save) during one worker step, on the engine's monotonic clock."""

    start: float = 0.0
    seconds: float = 0.0

    def add(self, start: float, end: float) -> None:
        self.start = self.start or start
        self.seconds += end - start


@dataclass(slots=True)
class StepTransferMetadata(KVConnectorWorkerMetadata):
    """What a worker spent loading and saving KV in one step, with the user's connector's own worker metadata.
    Workers of one engine (tensor parallel) move their shares at the same time: the slowest one's time is the
    step's."""

    step: int = -1
    """The scheduler's number for the step (`StepMetadata.step`)."""
    children: Any = None
    load: _Timer = field(default_factory=_Timer)
    save: _Timer = field(default_factory=_Timer)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, StepTransferMetadata)
        children = self.children if other.children is None else other.children
        if self.children is not None and other.children is not None:
            children = self.children.aggregate(other.children)
        load, save = (
            _Timer(min(x.start, y.start) or max(x.start, y.start), max(x.seconds, y.seconds))
            for x, y in ((self.load, other.load), (self.save, other.save))
        )
        return StepTransferMetadata(self.step, children, load, save)


@dataclass
class StepMetadata(MultiKVConnectorMetadata):
    """vLLM's metadata for the user's connector, numbered, so a worker's report names the step it is about."""

    step: int = -1
    loading_blocks: tuple[int, ...] = ()
    """The blocks the step loads into before its forward pass (`PhasescopeConnector.get_block_ids_with_load_errors`)."""


@dataclass(slots=True)
class RequestTransfer:
    """One request's KV moves so far (scheduler side)."""

    request: Request
    load: _Timer = field(default_factory=_Timer)
    save: _Timer = field(default_factory=_Timer)
    loaded_tokens: int = 0
    saved_tokens: int = 0
    loading_async: bool = False
    blocks: tuple[int, ...] = ()
    """The blocks vLLM gave the request when it took the match: those a load writes into."""

    def figures(self, bytes_per_token: float) -> dict[str, float]:
        """What the front end reads (`KvTransferFigures.from_params`)."""
        return {
            "load_start": self.load.start,
            "load_seconds": self.load.seconds,
            "save_start": self.save.start,
            "save_seconds": self.save.seconds,
            "loaded_tokens": self.loaded_tokens,
            "saved_tokens": self.saved_tokens,
            "bytes": (self.loaded_tokens + self.saved_tokens) * bytes_per_token,
        }


def wrapped_kv_transfer_config(config: dict[str, Any]) -> dict[str, Any]:
    """vLLM's KV-transfer configuration with the user's connector inside phasescope's (the role, engine id and
    buffer settings stay at the top level, where vLLM reads them)."""
    outer = {key: value for key, value in config.items() if key not in ("kv_connector", "kv_connector_module_path")}
    outer["kv_connector"] = CONNECTOR_NAME
    outer["kv_connector_module_path"] = MODULE_PATH
    # The child runs with the top level's engine id: vLLM's MultiConnector gives it that id, and fails to start
    # (KVTransferConfig "got multiple values for keyword argument 'engine_id'") when the child names one itself.
    child = {key: value for key, value in config.items() if key != "engine_id"}
    outer["kv_connector_extra_config"] = {"connectors": [child]}
    # A load that fails (a connector's stored entry shorter than its match) is recomputed, not the request failed.
    outer.setdefault("kv_load_failure_policy", "recompute")
    return outer


class PhasescopeConnector(MultiConnector):
    """The user's connector, its matches below one block refused (module docstring)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._block_size = int(vllm_config.cache_config.block_size)
        self._bytes_per_token = _kv_bytes_per_token(kv_cache_config)
        # Scheduler side: each request the connector was asked about, until it ends.
        self._transfers: dict[str, RequestTransfer] = {}
        # Per step scheduled and not yet reported, by its number: the requests loading in it, and those whose
        # prompt it computes (the tokens).
        self._steps: dict[int, tuple[list[str], dict[str, int]]] = {}
        self._next_step = 0
        self._saves = bool(vllm_config.kv_transfer_config.is_kv_producer)
        # The figures handed out with requests that ended in the update now running (`request_finished`).
        self._handed: list[tuple[dict[str, Any], RequestTransfer]] = []
        # Worker side: the step running, the blocks it loads and whether a load failed, and its moves.
        self._step = -1
        self._loading_blocks: tuple[int, ...] = ()
        self._load_failed = False
        self._load = _Timer()
        self._save = _Timer()

    # Worker side: each move timed where it runs.

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._step = getattr(connector_metadata, "step", -1)
        self._loading_blocks = getattr(connector_metadata, "loading_blocks", ())

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed: set[int] = super().get_block_ids_with_load_errors()
        if self._load_failed:
            # vLLM recomputes them (phasescope starts its connector with kv_load_failure_policy "recompute").
            failed |= set(self._loading_blocks)
            self._load_failed = False
        return failed

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        start = time.monotonic()
        try:
            super().start_load_kv(forward_context, **kwargs)
        except Exception:  # a load that fails is the step's blocks to recompute, never the engine's end
            self._load_failed_in_step("start_load_kv")
        self._load.add(start, time.monotonic())

    def wait_for_layer_load(self, layer_name: str) -> None:
        start = time.monotonic()
        try:
            super().wait_for_layer_load(layer_name)
        except Exception:
            self._load_failed_in_step("wait_for_layer_load")
        self._load.add(start, time.monotonic())

    def _load_failed_in_step(self, where: str) -> None:
        if not self._loading_blocks:
            raise  # nothing of ours was loading: not a load of a request's KV
        logger.warning(
            "the KV connector's %s failed; this step's %d loaded blocks are recomputed",
            where,
            len(self._loading_blocks),
            exc_info=True,
        )
        self._load_failed = True

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        start = time.monotonic()
        super().save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)
        self._save.add(start, time.monotonic())

    def wait_for_save(self) -> None:
        start = time.monotonic()
        super().wait_for_save()  # type: ignore[no-untyped-call]  # vLLM leaves it unannotated
        self._save.add(start, time.monotonic())

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        children = super().build_connector_worker_meta()
        load, save = self._load, self._save
        self._load, self._save = _Timer(), _Timer()
        return StepTransferMetadata(self._step, children, load, save)

    # Scheduler side.

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        transfer = self._transfers.setdefault(request.request_id, RequestTransfer(request))
        tokens, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if tokens is None:  # the connector is still looking
            return None, False
        if tokens <= 0 or num_computed_tokens + tokens < self._block_size:
            # Nothing, or less than one whole block (a connector can even answer a negative count): refused.
            self._requests_to_connector.pop(request.request_id, None)
            return 0, False
        if load_async:
            # The request now waits for its KV apart from the steps, from this scheduler pass on.
            transfer.load, transfer.loading_async = _Timer(time.monotonic()), True
        return tokens, load_async

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        transfer = self._transfers.get(request.request_id)
        if transfer is not None and num_external_tokens > 0:
            transfer.loaded_tokens = num_external_tokens  # what vLLM took of the match
            transfer.blocks = tuple(block for group in blocks.get_block_ids() for block in group) if blocks else ()

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        self._release()  # those outputs have left
        loading: list[str] = []
        loading_blocks: list[int] = []
        prompt: dict[str, int] = {}
        computed = {new.req_id: new.num_computed_tokens for new in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=False))
        for request_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            transfer = self._transfers.get(request_id)
            if transfer is None:
                continue
            before = computed.get(request_id, transfer.request.num_computed_tokens)
            if transfer.loaded_tokens and not transfer.loading_async and not transfer.load.start:
                loading.append(request_id)  # its KV loads in this step, before the forward pass
                loading_blocks.extend(transfer.blocks)
            prompt_tokens = min(scheduled, transfer.request.num_prompt_tokens - before)
            if prompt_tokens > 0 and self._saves:
                prompt[request_id] = prompt_tokens
        children = super().build_connector_meta(scheduler_output)
        step = self._next_step
        self._next_step += 1
        self._steps[step] = (loading, prompt)
        return StepMetadata(
            children.metadata, children.extra_async_saves, step=step, loading_blocks=tuple(loading_blocks)
        )

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        step = connector_output.kv_connector_worker_meta
        if isinstance(step, StepTransferMetadata):
            connector_output.kv_connector_worker_meta = step.children
            try:
                super().update_connector_output(connector_output)
            finally:
                connector_output.kv_connector_worker_meta = step
            for number in [number for number in self._steps if number <= step.step]:
                accounted = self._steps.pop(number)  # a step before it that never reported moved nothing
                if number == step.step:
                    self._account(step, *accounted, failed=connector_output.invalid_block_ids)
        else:
            super().update_connector_output(connector_output)
        now = time.monotonic()
        for request_id in connector_output.finished_recving or ():
            transfer = self._transfers.get(request_id)
            if transfer is not None and transfer.loading_async:
                transfer.load.seconds = now - transfer.load.start
        # The figures of a request that ended in this update take its last step's moves: its output has not
        # left the engine core yet.
        for params, transfer in self._handed:
            params[KV_TRANSFER_PARAMS_KEY] = transfer.figures(self._bytes_per_token)
        self._release()

    def _account(
        self, step: StepTransferMetadata, loading: list[str], prompt: dict[str, int], failed: set[int]
    ) -> None:
        for request_id in loading:
            transfer = self._transfers.get(request_id)
            if transfer is None:
                continue
            if step.load.seconds > 0.0:
                transfer.load = _Timer(step.load.start, step.load.seconds)
            if failed.intersection(transfer.blocks):
                transfer.loaded_tokens = 0  # its load failed and vLLM recomputes the prompt: nothing came through
        if step.save.seconds > 0.0:
            for request_id, tokens in prompt.items():
                transfer = self._transfers.get(request_id)
                if transfer is not None:
                    transfer.save.add(step.save.start, step.save.start + step.save.seconds)
                    transfer.saved_tokens += tokens

    def request_finished(self, request: Request, blocks: list[int]) -> tuple[bool, dict[str, Any] | None]:
        delay, params = super().request_finished(request, blocks)
        return delay, self._with_figures(request, params)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        delay, params = super().request_finished_all_groups(request, block_ids)
        return delay, self._with_figures(request, params)

    def _with_figures(self, request: Request, params: dict[str, Any] | None) -> dict[str, Any] | None:
        transfer = self._transfers.get(request.request_id)
        if params is not None and KV_TRANSFER_PARAMS_KEY in params:
            return params  # already added (request_finished_all_groups can call request_finished)
        if transfer is None:
            return params
        params = {**(params or {}), KV_TRANSFER_PARAMS_KEY: transfer.figures(self._bytes_per_token)}
        self._handed.append((params, transfer))
        return params

    def _release(self) -> None:
        """Forget the requests whose figures went out: their last step's report has been counted, or never comes."""
        for _, transfer in self._handed:
            self._transfers.pop(transfer.request.request_id, None)
        self._handed.clear()


def _kv_bytes_per_token(kv_cache_config: Any) -> float:
    """The KV cache's bytes per token over every layer (0.0 when the connector is not told the cache's shape)."""
    if kv_cache_config is None:
        return 0.0
    return float(
        sum(
            group.kv_cache_spec.page_size_bytes * len(group.layer_names) / group.kv_cache_spec.block_size
            for group in kv_cache_config.kv_cache_groups
        )
    )
