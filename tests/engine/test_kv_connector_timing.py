"""phasescope's KV connector timing each request's transfer, against vLLM's own connector classes.

The user's connector is the boundary: its answers (a match loaded in the step or apart from the steps, nothing to
hand on) are scripted by replacing the MultiConnector methods phasescope's connector forwards to. The scheduler's
calls come in the order vLLM's scheduler makes them within one update: `request_finished` for the requests that
ended, then `update_connector_output` with the step's worker report. The real engine is in
tests/integration/test_kv_transfer.py.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector, MultiKVConnectorMetadata
from vllm.v1.outputs import KVConnectorOutput

from phasescope.bench.tiny_model import ensure_tiny_model
from phasescope.engine.vllm.engine import _kv_transfer, engine_config
from phasescope.engine.vllm.kv_connector import PhasescopeConnector, StepMetadata, StepTransferMetadata, _Timer
from phasescope.telemetry.request.phases import KvTransferFigures

BLOCK = 128
# One KV cache group of 30 layers, 128 tokens a block, 1,152 bytes per token per layer.
KV_CACHE = SimpleNamespace(
    kv_cache_groups=[
        SimpleNamespace(
            kv_cache_spec=SimpleNamespace(page_size_bytes=1152 * BLOCK, block_size=BLOCK), layer_names=["l"] * 30
        )
    ]
)
BYTES_PER_TOKEN = 1152 * 30


@pytest.fixture
def connector(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> PhasescopeConnector:
    from vllm.engine.arg_utils import AsyncEngineArgs

    kv = _kv_transfer(
        json.dumps(
            {
                "kv_connector": "ExampleConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)},
            }
        )
    )
    assert kv is not None
    config = engine_config(
        AsyncEngineArgs(
            model=str(ensure_tiny_model()),
            kv_transfer_config=kv.engine_config,  # type: ignore[arg-type]  # vLLM's validation takes the JSON
            disable_hybrid_kv_cache_manager=True,
        )
    )
    made = PhasescopeConnector(config, KVConnectorRole.SCHEDULER, KV_CACHE)
    # The user's connector: nothing to hand on, no metadata of its own.
    monkeypatch.setattr(MultiConnector, "update_state_after_alloc", lambda *args: None)
    monkeypatch.setattr(MultiConnector, "request_finished", lambda *args: (False, None))
    monkeypatch.setattr(MultiConnector, "request_finished_all_groups", lambda *args: (False, None))
    monkeypatch.setattr(MultiConnector, "update_connector_output", lambda *args: None)
    monkeypatch.setattr(MultiConnector, "build_connector_meta", lambda *args: MultiKVConnectorMetadata(metadata=()))
    return made


def matches(monkeypatch: pytest.MonkeyPatch, tokens: int, load_async: bool) -> None:
    monkeypatch.setattr(MultiConnector, "get_num_new_matched_tokens", lambda *args: (tokens, load_async))


def request(request_id: str, prompt_tokens: int) -> Any:
    return SimpleNamespace(request_id=request_id, num_prompt_tokens=prompt_tokens, num_computed_tokens=0)


def scheduled(new: dict[str, int], computed: dict[str, int]) -> Any:
    """A scheduler output: each new request's tokens scheduled in the step, with its tokens computed before."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=rid, num_computed_tokens=computed[rid]) for rid in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens=new,
    )


def bare_worker() -> PhasescopeConnector:
    """The connector's worker side alone (its calls to the user's connector are scripted by each test)."""
    worker = PhasescopeConnector.__new__(PhasescopeConnector)
    worker._step, worker._loading_blocks, worker._load_failed = -1, (), False
    worker._load, worker._save = _Timer(), _Timer()
    return worker


def figures(params: dict[str, Any] | None) -> KvTransferFigures:
    rest, transfer = KvTransferFigures.from_params(params)
    assert rest is None  # only phasescope's own figures: the client sees no parameters
    assert transfer is not None
    return transfer


def test_a_load_apart_from_the_steps_spans_the_pass_that_started_it_to_its_workers_report(
    connector: PhasescopeConnector, monkeypatch: pytest.MonkeyPatch
) -> None:
    decode = request("decode-1", 300)
    matches(monkeypatch, 256, load_async=True)
    started = time.monotonic()
    assert connector.get_num_new_matched_tokens(decode, 0) == (256, True)
    connector.update_state_after_alloc(decode, None, 256)
    time.sleep(0.05)
    connector.update_connector_output(KVConnectorOutput(finished_recving={"decode-1"}))
    finished = time.monotonic()
    _, params = connector.request_finished(decode, [])
    transfer = figures(params)
    assert started <= transfer.start <= started + 0.01
    assert 0.05 <= transfer.seconds <= finished - started
    assert (transfer.loaded_tokens, transfer.saved_tokens, transfer.bytes) == (256, 0, 256 * BYTES_PER_TOKEN)


def test_a_load_and_save_inside_a_step_are_the_workers_times_for_that_step_and_its_last_step_counts(
    connector: PhasescopeConnector, monkeypatch: pytest.MonkeyPatch
) -> None:
    both = request("both-1", 356)
    matches(monkeypatch, 256, load_async=False)
    assert connector.get_num_new_matched_tokens(both, 0) == (256, False)
    connector.update_state_after_alloc(both, None, 256)
    meta = connector.build_connector_meta(scheduled({"both-1": 100}, {"both-1": 256}))
    assert isinstance(meta, StepMetadata)
    # The request ends in this very step (one output token): vLLM calls request_finished before it hands the
    # connector the step's worker report, and the figures handed out take that report in.
    _, params = connector.request_finished(both, [])
    report = StepTransferMetadata(meta.step, None, load=_Timer(10.0, 0.04), save=_Timer(10.2, 0.02))
    connector.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=report))
    transfer = figures(params)
    assert transfer.start == 10.0
    assert transfer.seconds == pytest.approx(0.06)
    # 256 loaded; the other 100 computed in the step, and saved.
    assert (transfer.loaded_tokens, transfer.saved_tokens) == (256, 100)
    assert transfer.bytes == 356 * BYTES_PER_TOKEN


def test_a_worker_report_is_counted_for_the_step_it_names(
    connector: PhasescopeConnector, monkeypatch: pytest.MonkeyPatch
) -> None:
    matches(monkeypatch, 0, load_async=False)
    first, second = request("first", 200), request("second", 200)
    for each in (first, second):
        assert connector.get_num_new_matched_tokens(each, 0) == (0, False)
    one = connector.build_connector_meta(scheduled({"first": 200}, {"first": 0}))
    two = connector.build_connector_meta(scheduled({"second": 200}, {"second": 0}))
    assert isinstance(one, StepMetadata)
    assert isinstance(two, StepMetadata)
    # The first step's report never came (an empty step); the second's saves are the second request's only.
    report = StepTransferMetadata(two.step, None, save=_Timer(20.0, 0.03))
    connector.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=report))
    assert figures(connector.request_finished(second, [])[1]).saved_tokens == 200
    assert not figures(connector.request_finished(first, [])[1]).moved


def test_the_worker_times_its_moves_per_step_and_workers_of_one_step_take_the_slowest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = bare_worker()
    monkeypatch.setattr(MultiConnector, "bind_connector_metadata", lambda *args: None)
    monkeypatch.setattr(MultiConnector, "start_load_kv", lambda *args, **kwargs: time.sleep(0.02))
    monkeypatch.setattr(MultiConnector, "wait_for_save", lambda *args: time.sleep(0.01))
    monkeypatch.setattr(MultiConnector, "build_connector_worker_meta", lambda *args: None)
    worker.bind_connector_metadata(StepMetadata(metadata=(), step=7))
    before = time.monotonic()
    worker.start_load_kv(None)
    worker.wait_for_save()
    report = worker.build_connector_worker_meta()
    assert isinstance(report, StepTransferMetadata)
    assert report.step == 7
    assert before <= report.load.start < report.save.start
    assert report.load.seconds >= 0.02
    assert report.save.seconds >= 0.01
    # The next step starts from nothing.
    assert worker._load == _Timer()
    # Two tensor-parallel workers moved their shares at once: the step took the slower one's time.
    other = StepTransferMetadata(7, None, load=_Timer(report.load.start - 0.001, 0.5), save=_Timer())
    both = report.aggregate(other)
    assert isinstance(both, StepTransferMetadata)
    assert (both.load.start, both.load.seconds) == (report.load.start - 0.001, 0.5)
    assert (both.save.start, both.save.seconds) == (report.save.start, report.save.seconds)


def test_a_load_that_fails_is_its_steps_blocks_to_recompute_and_nothing_loaded(
    connector: PhasescopeConnector, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Scheduler side: vLLM gave the request blocks 4-7 for the match; the step loads into them.
    loading = request("short-entry", 600)
    matches(monkeypatch, 512, load_async=False)
    connector.get_num_new_matched_tokens(loading, 0)
    connector.update_state_after_alloc(loading, SimpleNamespace(get_block_ids=lambda: ([4, 5, 6, 7, 8],)), 512)
    meta = connector.build_connector_meta(scheduled({"short-entry": 88}, {"short-entry": 512}))
    assert isinstance(meta, StepMetadata)
    assert meta.loading_blocks == (4, 5, 6, 7, 8)
    # Worker side: the user's connector raises while loading (the ExampleConnector's "shape mismatch").
    worker = bare_worker()
    monkeypatch.setattr(MultiConnector, "bind_connector_metadata", lambda *args: None)
    monkeypatch.setattr(MultiConnector, "get_block_ids_with_load_errors", lambda *args: set())

    def shape_mismatch(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("shape mismatch: value tensor of shape [256, 3, 128] cannot be broadcast")

    monkeypatch.setattr(MultiConnector, "start_load_kv", shape_mismatch)
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)  # does not raise: vLLM recomputes the blocks
    assert worker.get_block_ids_with_load_errors() == {4, 5, 6, 7, 8}
    assert worker.get_block_ids_with_load_errors() == set()  # reported once
    # A failure in a step that loads nothing of a request's is not a load's: it stays the engine's to see.
    worker.bind_connector_metadata(StepMetadata(metadata=(), step=meta.step + 1))
    with pytest.raises(RuntimeError, match="shape mismatch"):
        worker.start_load_kv(None)
    # Back on the scheduler side, the step's report with the failed blocks: nothing came through the connector.
    report = StepTransferMetadata(meta.step, None, load=_Timer(30.0, 0.01))
    connector.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=report, invalid_block_ids={4, 5}))
    transfer = figures(connector.request_finished(loading, [])[1])
    assert transfer.loaded_tokens == 0
    assert transfer.seconds == pytest.approx(0.01)


def test_phasescope_starts_its_connector_recomputing_failed_loads_unless_told_otherwise() -> None:
    from phasescope.engine.vllm.kv_connector import wrapped_kv_transfer_config

    example = {"kv_connector": "ExampleConnector", "kv_role": "kv_consumer"}
    assert wrapped_kv_transfer_config(example)["kv_load_failure_policy"] == "recompute"
    told = wrapped_kv_transfer_config({**example, "kv_load_failure_policy": "fail"})
    assert told["kv_load_failure_policy"] == "fail"
