"""--kv-transfer-config against vLLM's own classes: what vLLM refuses is one line naming the flag and the field,
and the connector is reported as vLLM's worker reports it (served end to end in
tests/integration/test_kv_transfer.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from phasescope.bench.tiny_model import ensure_tiny_model
from phasescope.engine.base import EngineConfigError, KvConnector
from phasescope.engine.vllm.engine import _kv_connector, _kv_transfer, engine_config

EXAMPLE = {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}


def wrapped(kv_transfer: dict[str, Any]) -> Any:
    """The user's connector checked and wrapped, as phasescope hands it to the engine."""
    kv = _kv_transfer(json.dumps(kv_transfer))
    assert kv is not None
    return kv


def engine_args(kv: Any, speculative: dict[str, Any] | None = None) -> Any:
    """The engine's arguments as phasescope builds them, with the wrapped connector `kv`."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs(
        model=str(ensure_tiny_model()),
        kv_transfer_config=kv.engine_config,  # type: ignore[arg-type]  # vLLM's validation takes the object's JSON, as its CLI hands it over
        disable_hybrid_kv_cache_manager=True if not kv.hybrid_allocator else None,
        speculative_config=speculative,
    )


@pytest.mark.parametrize(
    ("kv_transfer", "named"),
    [
        ({"kv_connector": "ExampleConnector", "kv_role": "both"}, "kv_role"),
        ({"kv_connector": "ExampleConnector"}, "kv_role"),
        ({**EXAMPLE, "no_such_field": 1}, "no_such_field"),
        ({"kv_connector": "NoSuchConnector", "kv_role": "kv_both"}, "NoSuchConnector"),
    ],
    ids=["a role vLLM has not", "no role", "an unknown field", "an unknown connector"],
)
def test_a_kv_transfer_config_vllm_refuses_is_one_line_naming_the_flag_and_field(
    kv_transfer: dict[str, Any], named: str
) -> None:
    with pytest.raises(EngineConfigError) as caught:
        _kv_transfer(json.dumps(kv_transfer))
    message = str(caught.value)
    assert message.startswith("--kv-transfer-config: ")
    assert named in message
    assert "\n" not in message


def test_with_both_json_configs_the_one_vllm_refuses_is_the_one_named() -> None:
    with pytest.raises(EngineConfigError) as kv:
        _kv_transfer(json.dumps({"kv_connector": "NoSuchConnector", "kv_role": "kv_both"}))
    assert str(kv.value).startswith("--kv-transfer-config: ")
    with pytest.raises(EngineConfigError) as speculative:
        engine_config(engine_args(wrapped(EXAMPLE), {"method": "ngram", "num_speculative_tokens": -1}))
    assert str(speculative.value).startswith("--speculative-config: ")
    assert "num_speculative_tokens" in str(speculative.value)


def test_the_connector_vllm_accepts_is_reported_with_its_role_and_the_engine_id_vllm_gave_it(tmp_path: Path) -> None:
    kv = wrapped({**EXAMPLE, "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}})
    config = engine_config(engine_args(kv))
    connector = _kv_connector(kv.given)
    assert connector is not None
    assert (connector.connector, connector.role) == ("ExampleConnector", "kv_both")
    # Given none, vLLM makes one up (a UUID), and that is the id its peers know it by: the engine, phasescope's
    # connector and the user's connector inside it all run with the id GetServerInfo reports.
    assert connector.engine_id == config.kv_transfer_config.engine_id != ""
    # The user's connector as vLLM's MultiConnector makes it inside phasescope's.
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    ((child_class, child_config),) = MultiConnector._get_connector_classes_and_configs(config)
    assert child_class.__name__ == "ExampleConnector"
    assert child_config.kv_transfer_config is not None
    assert child_config.kv_transfer_config.engine_id == connector.engine_id


def test_an_engine_id_the_operator_names_is_the_one_the_engine_and_its_connector_run_with() -> None:
    kv = wrapped({**EXAMPLE, "engine_id": "prefill-0", "kv_connector_extra_config": {"shared_storage_path": "x"}})
    config = engine_config(engine_args(kv))
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    ((_, child_config),) = MultiConnector._get_connector_classes_and_configs(config)
    assert _kv_connector(kv.given) == KvConnector("ExampleConnector", "kv_both", "prefill-0")
    assert child_config.kv_transfer_config is not None
    assert config.kv_transfer_config.engine_id == child_config.kv_transfer_config.engine_id == "prefill-0"


def test_a_multi_connector_is_reported_as_its_one_mover_as_vllms_worker_reports_it() -> None:
    multi: dict[str, Any] = {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_consumer",
        "engine_id": "outer",
        "kv_connector_extra_config": {
            "connectors": [
                {"kv_connector": "NixlConnector", "kv_role": "kv_consumer", "engine_id": "decode-7"},
                {"kv_connector": "OffloadingConnector", "kv_role": "kv_consumer"},
            ]
        },
    }
    from vllm.config import KVTransferConfig

    assert _kv_connector(KVTransferConfig(**multi)) == KvConnector("NixlConnector", "kv_consumer", "decode-7")


def test_no_configuration_or_one_without_a_connector_is_no_connector() -> None:
    from vllm.config import KVTransferConfig

    assert _kv_connector(None) is None
    assert _kv_connector(KVTransferConfig()) is None
