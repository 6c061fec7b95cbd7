"""The targets' flags through the real parser: --compare-protocol, --vllm-grpc-address, --gateway-url."""

from __future__ import annotations

from pathlib import Path

import pytest

from phasescope.bench.config import BenchConfig, ConfigError, from_args
from phasescope.cli.main import build_parser


def config(tmp_path: Path, *flags: str) -> BenchConfig:
    argv = ["bench", "--output-dir", str(tmp_path), *flags]
    return from_args(build_parser().parse_args(argv), argv)


def test_compare_compares_both_protocols_unless_narrowed(tmp_path: Path) -> None:
    plain = config(tmp_path, "--compare")
    assert plain.compare_protocol == "all"
    assert plain.parameters()["compare_protocol"] == "all"
    for choice in ("all", "phasescope", "engine", "rust"):
        narrowed = config(tmp_path, "--compare", "--compare-protocol", choice)
        assert narrowed.compare_protocol == choice
        assert narrowed.starts_phasescope
        assert narrowed.starts_servers
    assert config(tmp_path).parameters()["compare_protocol"] is None  # nothing compared


def test_compare_protocol_needs_compare_and_one_of_its_choices(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"--compare-protocol.*--compare"):
        config(tmp_path, "--compare-protocol", "engine")
    with pytest.raises(SystemExit):
        config(tmp_path, "--compare", "--compare-protocol", "openai")


def test_a_vllm_grpc_address_is_host_and_port(tmp_path: Path) -> None:
    assert config(tmp_path, "--vllm-grpc-address", "127.0.0.1:50051").vllm_grpc_address == "127.0.0.1:50051"
    assert config(tmp_path, "--vllm-grpc-address", "[::1]:50051").vllm_grpc_address == "[::1]:50051"
    for wrong in ("127.0.0.1", ":50051", "localhost:port", "localhost:0", "localhost:70000"):
        with pytest.raises(ConfigError, match="--vllm-grpc-address"):
            config(tmp_path, "--vllm-grpc-address", wrong)


def test_a_gateway_url_is_http_without_its_trailing_slash(tmp_path: Path) -> None:
    assert config(tmp_path, "--gateway-url", "http://127.0.0.1:30000/").gateway_url == "http://127.0.0.1:30000"
    assert config(tmp_path, "--gateway-url", "https://gw.example").gateway_url == "https://gw.example"
    for wrong in ("127.0.0.1:30000", "grpc://127.0.0.1:1", "http://"):
        with pytest.raises(ConfigError, match="--gateway-url"):
            config(tmp_path, "--gateway-url", wrong)


def test_named_endpoints_alone_start_nothing_and_are_written_into_the_results(tmp_path: Path) -> None:
    alone = config(tmp_path, "--vllm-grpc-address", "127.0.0.1:1", "--gateway-url", "http://127.0.0.1:2")
    assert alone.external
    assert not alone.starts_phasescope
    assert not alone.measures_phasescope
    assert not alone.starts_servers
    assert alone.parameters()["vllm_grpc_address"] == "127.0.0.1:1"
    assert alone.parameters()["gateway_url"] == "http://127.0.0.1:2"
    beside = config(tmp_path, "--gateway-url", "http://127.0.0.1:2", "--address", "127.0.0.1:3")
    assert beside.measures_phasescope
    assert not beside.starts_phasescope
    assert not beside.starts_servers
    compared = config(tmp_path, "--gateway-url", "http://127.0.0.1:2", "--compare", "--tiny-model")
    assert compared.starts_phasescope
    assert compared.starts_servers
    default = config(tmp_path)
    assert not default.external
    assert default.starts_phasescope


def test_the_tiny_model_needs_something_started(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--tiny-model"):
        config(tmp_path, "--tiny-model", "--vllm-grpc-address", "127.0.0.1:1")
    with pytest.raises(ConfigError, match="--tiny-model"):
        config(tmp_path, "--tiny-model", "--gateway-url", "http://127.0.0.1:2")


def test_rounds_are_the_repeats_and_every_setting_of_the_servers_is_written_into_the_results(tmp_path: Path) -> None:
    rounds = config(tmp_path, "--compare", "--compare-protocol", "engine", "--rounds", "12", "--settle", "1.5",
                    "--serve-args", "PYTHONSAFEPATH=1 PYTHONPATH='/a b' --event-loop asyncio",
                    "--variant", "b=LD_PRELOAD= --stream-interval 8")  # fmt: skip
    assert rounds.repeats == 12
    assert rounds.serve.env == {"PYTHONSAFEPATH": "1", "PYTHONPATH": "/a b"}
    assert rounds.serve.args == ("--event-loop", "asyncio")
    (variant,) = rounds.variants
    assert (variant.name, variant.env, variant.args) == ("b", {"LD_PRELOAD": ""}, ("--stream-interval", "8"))
    assert rounds.target_names == ["vllm-grpc", "phasescope-vllm-grpc", "b-vllm-grpc"]
    parameters = rounds.parameters()
    assert parameters["repeats"] == 12
    assert parameters["settle_seconds"] == 1.5
    assert parameters["variants"] == [{"name": "b", "env": {"LD_PRELOAD": ""}, "args": ["--stream-interval", "8"]}]
    assert config(tmp_path, "--repeats", "3").repeats == 3


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--variant", "B=--event-loop asyncio"), "NAME=WORDS"),
        (("--variant", "gateway="), "a target's name"),
        (("--variant", "x-vllm-grpc="), "a target's name"),
        (("--variant", "b=", "--variant", "b=--stream-interval 8"), "a name of its own"),
        (("--address", "127.0.0.1:1", "--serve-args", "--event-loop asyncio"), "--address"),
        (("--vllm-grpc-address", "127.0.0.1:1", "--variant", "b="), "starts none"),
        (("--compare", "--compare-protocol", "engine", "--baseline", "vllm-openai"), "not measured here"),
        (("--serve-args", "'unclosed"), "--serve-args"),
        (("--settle", "-1"), "--settle"),
    ],
)
def test_servers_and_baselines_that_cannot_be_are_one_line(
    tmp_path: Path, flags: tuple[str, ...], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        config(tmp_path, *flags)


def test_an_adapter_mix_is_checked_and_needs_a_phasescope_started_here(tmp_path: Path) -> None:
    mixed = config(tmp_path, "--tiny-model", "--adapters", "4", "--adapter-mix", "zipf:1.2", "--adapter-rank", "16")
    assert (mixed.workload.adapters, mixed.adapter_rank) == (4, 16)
    parameters = mixed.parameters()
    assert (parameters["adapters"], parameters["adapter_mix"], parameters["adapter_rank"]) == (4, "zipf:1.2", 16)
    assert config(tmp_path).parameters()["adapter_mix"] is None
    for flags, message in (
        (("--adapters", "2", "--address", "127.0.0.1:1"), "drop --address"),
        (("--adapters", "2", "--compare"), "drop --compare"),
        (("--adapters", "2", "--adapter-rank", "7"), "--adapter-rank must be one of 1, 8, 16"),
        (("--adapters", "2", "--adapter-mix", "pareto"), "--adapter-mix: 'pareto' is not uniform"),
        (("--adapters", "-1",), "--adapters must be 0 or more"),
    ):  # fmt: skip
        with pytest.raises(ConfigError, match=message):
            config(tmp_path, *flags)


def test_peer_first_needs_an_engine_protocol_peer_started_beside_a_phasescope_started_here(tmp_path: Path) -> None:
    assert config(tmp_path, "--compare", "--compare-protocol", "rust", "--peer-first").parameters()["peer_first"]
    assert config(tmp_path, "--compare").parameters()["peer_first"] is False
    for flags in ((), ("--compare", "--compare-protocol", "phasescope")):
        with pytest.raises(ConfigError, match=r"--peer-first.*--compare"):
            config(tmp_path, *flags, "--peer-first")
    with pytest.raises(ConfigError, match=r"--peer-first.*--address"):
        config(tmp_path, "--compare", "--address", "127.0.0.1:7", "--peer-first")
