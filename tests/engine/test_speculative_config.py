"""Speculative decoding's configuration and per-sample counts against vLLM's own classes (served end to end in
tests/integration/test_speculative.py)."""

from __future__ import annotations

import json

import pytest

from phasescope.bench.tiny_model import ensure_tiny_model
from phasescope.engine.base import EngineConfigError
from phasescope.engine.vllm.engine import _speculation, engine_config


def engine_args(speculative: dict[str, object]) -> object:
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs(model=str(ensure_tiny_model()), speculative_config=json.loads(json.dumps(speculative)))


@pytest.mark.parametrize(
    ("speculative", "named"),
    [
        ({"method": "ngram", "num_speculative_tokens": -1}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 3, "no_such_field": 1}, "no_such_field"),
    ],
)
def test_a_speculative_config_vllm_refuses_is_one_line_naming_the_flag_and_field(
    speculative: dict[str, object], named: str
) -> None:
    with pytest.raises(EngineConfigError) as caught:
        engine_config(engine_args(speculative))
    message = str(caught.value)
    assert message.startswith("--speculative-config: ")
    assert named in message
    assert "\n" not in message


def test_an_n_gram_config_vllm_accepts_is_its_own_k() -> None:
    config = engine_config(engine_args({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}))
    assert (config.speculative_config.method, config.speculative_config.num_speculative_tokens) == ("ngram", 3)


def test_a_samples_accepted_tokens_are_its_histogram_of_accepted_drafts_weighted_by_count() -> None:
    from vllm.v1.metrics.stats import RequestSpecDecodeMetrics

    # k = 3 over 5 verify steps: twice none accepted, once 1, twice all 3 → 0 + 1 + 6 = 7 of 15 drafted.
    metrics = RequestSpecDecodeMetrics(num_spec_tokens=3, histogram=[2, 1, 0, 2], num_draft_tokens=15)
    assert _speculation(metrics) == {"drafted_tokens": 15, "accepted_tokens": 7}
    assert _speculation(None) == {}
