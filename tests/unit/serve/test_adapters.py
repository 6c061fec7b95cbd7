"""LoRA adapters on both protocols, over the scripted engine: a request selects one by name, an adapter the
worker does not serve is refused naming where it came from, and adapters are loaded and unloaded only where the
operator allowed it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb

from phasescope.bench.adapters import write_lora_adapter
from phasescope.client.client import build_request
from phasescope.serve.timings import TIMINGS_METADATA_KEY
from phasescope.v1 import inference_pb2 as pb
from support.fake_engine import CONFIG, ScriptedEngine
from support.served import eventually, served


def engine_request(request_id: str) -> vllm_pb.GenerateRequest:
    return vllm_pb.GenerateRequest(
        request_id=request_id,
        tokenized=vllm_pb.TokenizedInput(input_ids=[5, 6, 7]),
        sampling_params=vllm_pb.SamplingParams(max_tokens=2),
    )


async def test_a_request_runs_with_the_adapter_it_names_on_either_protocol(tmp_path: Path) -> None:
    engine = ScriptedEngine(max_loras=2)
    async with served(engine, allow_adapter_updates=True) as s:
        folder = write_lora_adapter(tmp_path / "sql", CONFIG, rank=8)
        info = await s.client.load_adapter("sql", str(folder))
        assert (info.name, info.rank, list(info.target_modules)) == ("sql", 8, ["q_proj", "v_proj"])
        with_adapter = await s.client.generate(build_request(prompt="a b", max_tokens=2, adapter="sql"))
        base = await s.client.generate(build_request(prompt="a b", max_tokens=2))
        # Its Timings name the adapter it ran with.
        assert (with_adapter.timings.adapter, base.timings.adapter) == ("sql", "")
        responses = s.stub.Generate(engine_request("e-1"), metadata=(("phasescope-adapter", "sql"),))
        async for _ in responses:
            pass
        trailing = dict(await responses.trailing_metadata())
        assert pb.Timings.FromString(trailing[TIMINGS_METADATA_KEY]).adapter == "sql"
    assert list(engine.adapter_of.values()) == ["sql", "", "sql"]


async def test_an_adapter_not_served_is_not_found_naming_the_field_and_what_is_served(tmp_path: Path) -> None:
    engine = ScriptedEngine(max_loras=1)
    async with served(engine, allow_adapter_updates=True) as s:
        await s.client.load_adapter("sql", str(write_lora_adapter(tmp_path / "sql", CONFIG)))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await s.client.generate(build_request(prompt="a b", max_tokens=2, adapter="chat"))
        assert caught.value.code() is grpc.StatusCode.NOT_FOUND
        assert caught.value.details() == "adapter: no adapter named 'chat' is served (served: sql)"
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in s.stub.Generate(engine_request("e-2"), metadata=(("phasescope-adapter", "chat"),)):
                pass
        assert caught.value.code() is grpc.StatusCode.NOT_FOUND
        assert (caught.value.details() or "").startswith("metadata phasescope-adapter: no adapter named 'chat'")
        # Refused before the engine, and counted so; the server keeps serving.
        assert s.value("phasescope_requests_rejected_total", reason="not_found") == 2
        assert engine.started == []
        await s.client.generate(build_request(prompt="a b", max_tokens=2))


async def test_a_worker_without_lora_refuses_an_adapter_as_not_configured() -> None:
    async with served(ScriptedEngine()) as s:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await s.client.generate(build_request(prompt="a b", max_tokens=2, adapter="sql"))
    assert caught.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "adapter: this worker runs no LoRA adapters" in (caught.value.details() or "")


async def test_loading_and_unloading_are_refused_unless_the_operator_allowed_updates(tmp_path: Path) -> None:
    async with served(ScriptedEngine(max_loras=1)) as s:
        for call in (
            s.client.load_adapter("sql", str(write_lora_adapter(tmp_path, CONFIG))),
            s.client.unload_adapter("sql"),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call
            assert caught.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert "--allow-adapter-updates" in (caught.value.details() or "")
        assert await s.client.list_adapters() == []


async def test_load_list_and_unload_and_each_refusal_names_its_field(tmp_path: Path) -> None:
    engine = ScriptedEngine(max_loras=2)
    async with served(engine, allow_adapter_updates=True) as s:
        sql = str(write_lora_adapter(tmp_path / "sql", CONFIG, rank=8))
        await s.client.load_adapter("sql", sql)
        info = await s.client.model_info()
        assert (info.max_loras, info.max_lora_rank, [a.name for a in info.adapters]) == (2, 16, ["sql"])
        refusals = {
            ("sql", sql): (grpc.StatusCode.ALREADY_EXISTS, "name: an adapter named 'sql' is served already"),
            ("other", sql): (grpc.StatusCode.INVALID_ARGUMENT, "name: base and other are the series' own labels"),
            ("bad name!", sql): (grpc.StatusCode.INVALID_ARGUMENT, "name: an adapter name is 1 to 64 letters"),
            ("chat", ""): (grpc.StatusCode.INVALID_ARGUMENT, "path: must name the adapter's folder"),
            ("chat", str(tmp_path / "none")): (grpc.StatusCode.INVALID_ARGUMENT, "path: "),
            ("big", str(write_lora_adapter(tmp_path / "big", CONFIG, rank=32))): (
                grpc.StatusCode.INVALID_ARGUMENT, "path: rank 32 is above the engine's --max-lora-rank 16",
            ),
        }  # fmt: skip
        for (name, path), (code, details) in refusals.items():
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await s.client.load_adapter(name, path)
            assert (caught.value.code(), (caught.value.details() or "")[: len(details)]) == (code, details)
        assert [a.name for a in await s.client.list_adapters()] == ["sql"]
        assert (await s.client.unload_adapter("sql")).name == "sql"
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await s.client.unload_adapter("sql")
        assert caught.value.code() is grpc.StatusCode.NOT_FOUND
        assert await s.client.list_adapters() == []


async def test_each_adapters_requests_and_tokens_are_its_own_series_and_the_label_stays_bounded(
    tmp_path: Path,
) -> None:
    engine = ScriptedEngine(max_loras=2)  # three tokens a request (the default script)
    async with served(engine, allow_adapter_updates=True, max_adapter_labels=1) as s:
        for name in ("sql", "chat"):
            await s.client.load_adapter(name, str(write_lora_adapter(tmp_path / name, CONFIG)))
        for adapter in ("sql", "sql", "chat", ""):
            await s.client.generate(build_request(prompt="a b", max_tokens=3, adapter=adapter))
        with pytest.raises(grpc.aio.AioRpcError):
            await s.client.generate(build_request(prompt="a b", max_tokens=3, adapter="nobody"))
        # The first adapter seen keeps its name; with one label allowed, the next is "other", as is a name not
        # served (a refusal's: the client's text never becomes a label).
        await eventually(lambda: s.value("phasescope_requests_total", adapter="sql") == 2)
        assert s.value("phasescope_requests_total", adapter="other") == 1
        assert s.value("phasescope_requests_total", adapter="base") == 1
        assert s.value("phasescope_requests_total", adapter="chat") == 0
        assert s.value("phasescope_tokens_total", adapter="sql", phase="decode") == 6
        assert s.value("phasescope_tokens_total", adapter="other", phase="decode") == 3
        assert s.value("phasescope_tokens_total", phase="decode") == 12
        assert s.value("phasescope_requests_rejected_total", adapter="other", reason="not_found") == 1
        assert s.value("phasescope_time_to_first_token_seconds_count", adapter="sql") == 2
        assert s.value("phasescope_requests_in_flight", adapter="sql") == 0


def test_the_live_snapshot_counts_the_requests_in_flight_by_adapter() -> None:
    from types import SimpleNamespace

    from phasescope.serve.watch import adapter_snapshots
    from phasescope.telemetry.request.phases import EngineTimestamps, FrontendTimestamps
    from phasescope.telemetry.step.interference import NO_INTERFERENCE

    def request(adapter: str, decoding: bool) -> Any:
        # Handed to the engine at 1; decoding ones had their first token at 2 and their 11th at 4: 5 tok/s.
        stamps = EngineTimestamps(1.0, 1.5, 2.0, 4.0) if decoding else None
        return SimpleNamespace(
            request_id="r", prompt_tokens=4, front=FrontendTimestamps(0.5, 0.0, handed_to_engine=1.0),
            completion_tokens=11 if decoding else 0, stamps=stamps, interference=NO_INTERFERENCE, adapter=adapter,
        )  # fmt: skip

    assert adapter_snapshots([request("base", True)], now=5.0) == []  # no adapter in flight: no rows
    rows = adapter_snapshots(
        [request("sql", True), request("base", False), request("sql", True), request("sql", False)], now=5.0
    )
    assert [(r.adapter, r.in_flight, r.decoding, r.tokens_per_second) for r in rows] == [
        ("base", 1, 0, 0.0), ("sql", 3, 2, 10.0),
    ]  # fmt: skip
