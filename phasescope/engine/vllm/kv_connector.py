"""phasescope's KV connector: the connector given to --kv-transfer-config, wrapped so that no prompt takes the
engine down.

vLLM makes the connector in the engine core from `kv_connector_module_path`; `wrapped_kv_transfer_config` puts
the user's connector inside this one (vLLM's `MultiConnector` with that one child, which forwards every call).
What it adds: **no match below one block.** A connector's cache hit shorter than one whole KV block, or a count
below zero, is refused (0 tokens, nothing to load): vLLM allocates, loads and computes whole blocks. vLLM's
ExampleConnector, asked again for a prompt shorter than one block (128 tokens on CPU), answered a match of a
negative number of tokens, and the engine died with `IndexError: index out of range in self`
(docs/reliability.md). Such a prompt is computed, as it would be without a connector.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

if TYPE_CHECKING:
    from vllm.v1.request import Request

CONNECTOR_NAME = "PhasescopeConnector"
MODULE_PATH = __name__


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
    return outer


class PhasescopeConnector(MultiConnector):
    """The user's connector, its matches below one block refused (module docstring)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._block_size = int(vllm_config.cache_config.block_size)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        tokens, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if tokens is None:  # the connector is still looking
            return None, False
        if tokens <= 0 or num_computed_tokens + tokens < self._block_size:
            # Nothing, or less than one whole block (a connector can even answer a negative count): refused.
            self._requests_to_connector.pop(request.request_id, None)
            return 0, False
        return tokens, load_async
