"""loadtests.ttft_split: the servers a measurement runs, and how each compares with vLLM's worker round by round."""

import argparse
import math

import pytest

from loadtests.ttft_split import _ratios, _variants


def arguments(*variants: str, env: tuple[str, ...] = ()) -> argparse.Namespace:
    return argparse.Namespace(variant=list(variants), phasescope_env=list(env))


def test_each_variant_is_a_phasescope_server_with_its_own_environment() -> None:
    servers = _variants(arguments("old:PYTHONSAFEPATH=1,PYTHONPATH=/tmp/old", "bare:", env=("A=1",)))
    assert servers == {"phasescope": {"A": "1"}, "old": {"PYTHONSAFEPATH": "1", "PYTHONPATH": "/tmp/old"}, "bare": {}}


@pytest.mark.parametrize("variant", ["vllm:A=1", "phasescope:A=1", ":A=1", "x:A"])
def test_a_variant_that_would_be_mistaken_for_another_server_or_has_no_value_is_refused(variant: str) -> None:
    with pytest.raises(SystemExit):
        _variants(arguments(variant))


def test_ratios_pair_each_round_with_vllms_and_count_the_rounds_higher() -> None:
    rounds = [
        {"round": 1, "server": "phasescope", "median_ms": {"client_ttft": 30.0}},
        {"round": 1, "server": "vllm", "median_ms": {"client_ttft": 20.0}},
        {"round": 2, "server": "vllm", "median_ms": {"client_ttft": 40.0}},
        {"round": 2, "server": "phasescope", "median_ms": {"client_ttft": 20.0}},
        {"round": 3, "server": "phasescope", "median_ms": {"client_ttft": 33.0}},
        {"round": 3, "server": "vllm", "median_ms": {"client_ttft": 30.0}},
        {"round": 4, "server": "phasescope", "median_ms": {"client_ttft": 10.0}},  # vLLM's run missing
    ]
    ratio, higher, count = _ratios(rounds, "phasescope", "client_ttft")
    assert (round(ratio, 3), higher, count) == (1.1, 2, 3)
    assert math.isnan(_ratios(rounds, "other", "client_ttft")[0])
