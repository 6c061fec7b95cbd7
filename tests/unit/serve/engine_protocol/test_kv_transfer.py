"""Disaggregated prefill and decode on vLLM's engine protocol, over the scripted engine: a request's
`kv_transfer_params` reach the engine as vLLM's servicer hands them over, the connector's answer comes back on
`GenerateComplete` as vLLM's servicer writes it, and what cannot be served is a precise status (served end to
end with vLLM's ExampleConnector in tests/integration/test_kv_transfer.py)."""

from __future__ import annotations

import json
from typing import Any

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from phasescope.engine.base import KvConnector
from phasescope.engine.request import KvTransfer, SamplingSpec
from phasescope.errors import InvalidRequestError
from phasescope.serve.engine_protocol.facts import server_info
from phasescope.serve.engine_protocol.requests import decode_kv_transfer
from support.fake_engine import Script, ScriptedEngine
from support.served import Served, eventually, served

CONNECTOR = KvConnector(connector="NixlConnector", role="kv_producer", engine_id="prefill-0")
# What a NIXL prefill worker answers for the decode worker (vLLM's NixlConnector.request_finished).
PREFILL_ANSWER = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [1, 2, 3],
    "remote_engine_id": "prefill-0",
    "remote_host": "10.0.0.7",
    "remote_port": 5600,
    "tp_size": 1,
}


def generate(stream: bool = True, **fields: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id="pd-1",
        tokenized=pb.TokenizedInput(input_ids=[5, 6, 7]),
        sampling_params=pb.SamplingParams(max_tokens=4),
        stream=stream,
        **fields,
    )


def asked(s: Served) -> SamplingSpec:
    """What the engine was asked for the one request it started."""
    (sampling,) = s.engine.sampling.values()
    return sampling


async def completes(s: Served, request: pb.GenerateRequest) -> list[pb.GenerateComplete]:
    return [r.complete async for r in s.stub.Generate(request) if r.HasField("complete")]


# --- decoding, as vLLM's servicer reads the fields (smg-grpc-servicer's params_from_request) ---------------


def test_the_json_field_is_decoded_as_a_json_object_and_named_as_its_field() -> None:
    params = {"do_remote_decode": True, "nested": {"a": [1, 2]}}
    kv = decode_kv_transfer(generate(kv_transfer_params_json=json.dumps(params)))
    assert kv == KvTransfer(params, "kv_transfer_params_json")


def test_the_typed_field_is_a_host_and_a_port() -> None:
    kv = decode_kv_transfer(generate(kv_transfer_params=pb.KvTransferParams(remote_host="10.0.0.7", remote_port=5600)))
    assert kv == KvTransfer({"remote_host": "10.0.0.7", "remote_port": 5600}, "kv_transfer_params")


def test_with_both_fields_the_json_one_wins_as_in_vllms_servicer() -> None:
    kv = decode_kv_transfer(
        generate(
            kv_transfer_params=pb.KvTransferParams(remote_host="h", remote_port=1),
            kv_transfer_params_json='{"do_remote_prefill": true}',
        )
    )
    assert kv == KvTransfer({"do_remote_prefill": True}, "kv_transfer_params_json")


def test_no_parameters_and_an_empty_object_ask_for_nothing() -> None:
    # vLLM's servicer hands the engine nothing for an empty object either.
    assert decode_kv_transfer(generate()) is None
    assert decode_kv_transfer(generate(kv_transfer_params_json="{}")) is None


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"kv_transfer_params_json": "[1, 2]"}, "kv_transfer_params_json"),
        ({"kv_transfer_params_json": '"text"'}, "kv_transfer_params_json"),
        ({"kv_transfer_params_json": '{"remote_host": '}, "kv_transfer_params_json"),
        ({"kv_transfer_params_json": ""}, "kv_transfer_params_json"),
        ({"kv_transfer_params": pb.KvTransferParams(remote_host="", remote_port=5600)}, "kv_transfer_params"),
        ({"kv_transfer_params": pb.KvTransferParams(remote_host="h", remote_port=0)}, "kv_transfer_params"),
        ({"kv_transfer_params": pb.KvTransferParams(remote_host="h", remote_port=70000)}, "kv_transfer_params"),
    ],
    ids=["a list", "a string", "not JSON", "empty text", "no host", "port 0", "port past 65535"],
)
def test_parameters_vllms_servicer_refuses_are_refused_naming_the_field(fields: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        decode_kv_transfer(generate(**fields))
    assert caught.value.field == field
    assert str(caught.value).startswith(f"{field}: ")


# --- GetServerInfo and phasescope.v1's GetModelInfo --------------------------------------------------------


def test_server_info_reports_the_connector_role_and_engine_id() -> None:
    info = server_info(
        ScriptedEngine(kv_connector=CONNECTOR).description,
        active_requests=0,
        uptime_seconds=1.0,
        last_receive_timestamp=0.0,
    )
    assert (info.kv_connector, info.kv_role, info.kv_engine_id) == ("NixlConnector", "kv_producer", "prefill-0")
    # Pairing facts the gateway compares between a prefill and a decode worker stay as they were.
    assert (info.block_size, info.kv_cache_dtype, info.model_dtype) == (16, "auto", "torch.float32")


async def test_both_protocols_say_which_connector_role_and_engine_id_the_worker_has() -> None:
    async with served(ScriptedEngine(kv_connector=CONNECTOR)) as s:
        server = await s.stub.GetServerInfo(pb.GetServerInfoRequest())
        model = await s.client.model_info()
    assert (server.kv_connector, server.kv_role, server.kv_engine_id) == ("NixlConnector", "kv_producer", "prefill-0")
    assert (model.kv_connector, model.kv_role, model.kv_engine_id) == ("NixlConnector", "kv_producer", "prefill-0")


async def test_without_a_connector_both_protocols_leave_the_fields_empty() -> None:
    async with served(ScriptedEngine()) as s:
        server = await s.stub.GetServerInfo(pb.GetServerInfoRequest())
        model = await s.client.model_info()
    assert (server.kv_connector, server.kv_role, server.kv_engine_id) == ("", "", "")
    assert (model.kv_connector, model.kv_role, model.kv_engine_id) == ("", "", "")


# --- the pass-through, both ways ----------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "unary"])
async def test_the_parameters_reach_the_engine_and_its_answer_comes_back_on_the_complete(stream: bool) -> None:
    sent = {"do_remote_decode": True, "do_remote_prefill": False}
    engine = ScriptedEngine(
        lambda prompt: Script(tokens=[11], kv_transfer_params=PREFILL_ANSWER), kv_connector=CONNECTOR
    )
    async with served(engine) as s:
        (complete,) = await completes(s, generate(stream, kv_transfer_params_json=json.dumps(sent)))
        assert asked(s).kv_transfer == KvTransfer(sent, "kv_transfer_params_json")
        assert s.engine.finished
    # As vLLM's servicer writes the answer: the JSON field, and the typed mirror for a host and a port.
    assert json.loads(complete.kv_transfer_params_json) == PREFILL_ANSWER
    assert (complete.kv_transfer_params.remote_host, complete.kv_transfer_params.remote_port) == ("10.0.0.7", 5600)
    assert list(complete.output_ids) == [11]


async def test_the_typed_parameters_reach_the_engine_as_a_host_and_a_port() -> None:
    async with served(ScriptedEngine(kv_connector=CONNECTOR)) as s:
        request = generate(kv_transfer_params=pb.KvTransferParams(remote_host="10.0.0.7", remote_port=5600))
        await completes(s, request)
        assert asked(s).kv_transfer == KvTransfer(
            {"remote_host": "10.0.0.7", "remote_port": 5600}, "kv_transfer_params"
        )


async def test_an_answer_without_a_host_and_port_comes_back_as_json_only() -> None:
    answer = {"remote_block_ids": [4], "remote_engine_id": "prefill-0"}
    engine = ScriptedEngine(lambda prompt: Script(kv_transfer_params=answer), kv_connector=CONNECTOR)
    async with served(engine) as s:
        (complete,) = await completes(s, generate(kv_transfer_params_json='{"do_remote_decode": true}'))
    assert json.loads(complete.kv_transfer_params_json) == answer
    assert not complete.HasField("kv_transfer_params")


async def test_a_request_without_parameters_asks_the_engine_for_no_transfer_and_gets_none_back() -> None:
    async with served(ScriptedEngine(kv_connector=CONNECTOR)) as s:
        (complete,) = await completes(s, generate())
        assert asked(s).kv_transfer is None
    assert not complete.HasField("kv_transfer_params")
    assert not complete.HasField("kv_transfer_params_json")


async def test_each_sample_of_an_n_request_carries_the_parameters_and_the_answer() -> None:
    # As vLLM's parallel sampling does: each sample is an engine request with the same parameters.
    engine = ScriptedEngine(
        lambda prompt: Script(tokens=[11, 12], kv_transfer_params=PREFILL_ANSWER), kv_connector=CONNECTOR
    )
    async with served(engine) as s:
        request = generate(False, kv_transfer_params_json='{"do_remote_decode": true}')
        request.sampling_params.n = 2
        request.sampling_params.temperature = 1.0
        completes_ = await completes(s, request)
        assert asked(s).kv_transfer == KvTransfer({"do_remote_decode": True}, "kv_transfer_params_json")
    assert [c.index for c in completes_] == [0, 1]
    assert all(json.loads(c.kv_transfer_params_json) == PREFILL_ANSWER for c in completes_)


# --- what cannot be served -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"kv_transfer_params_json": '{"do_remote_prefill": true}'}, "kv_transfer_params_json"),
        ({"kv_transfer_params": pb.KvTransferParams(remote_host="10.0.0.7", remote_port=5600)}, "kv_transfer_params"),
    ],
    ids=["json", "typed"],
)
async def test_parameters_on_a_worker_without_a_connector_are_failed_precondition_naming_the_field(
    fields: dict[str, Any], field: str
) -> None:
    async with served(ScriptedEngine()) as s:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await completes(s, generate(**fields))
        assert caught.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        details = caught.value.details() or ""
        assert details.startswith(f"{field}: ")
        assert "--kv-transfer-config" in details
        # Never silently served on its own: refused before the engine, counted once, and the server keeps serving.
        assert not s.engine.started
        await eventually(lambda: s.value("phasescope_requests_rejected_total", reason="not_configured") == 1)
        (complete,) = await completes(s, generate())
        assert complete.finish_reason == "length"


async def test_an_empty_object_is_served_without_a_connector() -> None:
    async with served(ScriptedEngine()) as s:
        (complete,) = await completes(s, generate(kv_transfer_params_json="{}"))
        assert asked(s).kv_transfer is None
    assert complete.finish_reason == "length"


async def test_malformed_parameters_are_invalid_argument_before_the_connector_is_asked_for() -> None:
    # Whether or not the worker has a connector, a request it could never serve is the caller's fault first.
    for engine in (ScriptedEngine(), ScriptedEngine(kv_connector=CONNECTOR)):
        async with served(engine) as s:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await completes(s, generate(kv_transfer_params_json="[1]"))
            assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert (caught.value.details() or "").startswith("kv_transfer_params_json: ")
            assert not s.engine.started
            await eventually(lambda: s.value("phasescope_requests_rejected_total", reason="invalid_argument") == 1)
            assert len(await completes(s, generate())) == 1
