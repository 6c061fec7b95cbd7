import argparse

import pytest

from phasescope.cli.main import build_parser
from phasescope.serve.config import Settings, SettingsError, parse_settings


def test_defaults_are_the_documented_ones() -> None:
    settings = parse_settings([], environ={})
    assert settings.port == 50051
    assert settings.metrics_port == 9400
    assert settings.model == ""
    assert settings.data_parallel_size == 1


def test_flag_beats_environment_which_beats_default() -> None:
    environ = {"PHASESCOPE_PORT": "6000", "PHASESCOPE_MAX_MODEL_LEN": "512", "PHASESCOPE_ENFORCE_EAGER": "true"}
    from_env = parse_settings([], environ=environ)
    assert (from_env.port, from_env.max_model_len, from_env.enforce_eager) == (6000, 512, True)
    from_flags = parse_settings(["--port", "7000", "--no-enforce-eager"], environ=environ)
    assert (from_flags.port, from_flags.max_model_len, from_flags.enforce_eager) == (7000, 512, False)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--port", "70000"], "--port"),
        (["--max-concurrent-requests", "0"], "--max-concurrent-requests"),
        (["--kv-cache-gib", "-1"], "--kv-cache-gib"),
        (["--dtype", "int3"], "--dtype"),
        (["--data-parallel-size", "0"], "--data-parallel-size"),
        (["--distributed-executor-backend", "slurm"], "--distributed-executor-backend"),
        (["--trace-sample-ratio", "1.5"], "--trace-sample-ratio"),
        (["--hardware", "abacus"], "--hardware"),
    ],
)
def test_bad_settings_are_refused_at_start(argv: list[str], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        parse_settings(argv, environ={})


def test_bad_environment_value_names_the_variable() -> None:
    with pytest.raises(SettingsError, match="PHASESCOPE_PORT"):
        parse_settings([], environ={"PHASESCOPE_PORT": "many"})


def test_serve_help_documents_every_setting() -> None:
    parser = build_parser()
    subparsers = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    serve = subparsers.choices["serve"]
    help_text = serve.format_help()
    # Every field of the one settings object is a flag: a new setting cannot be left out.
    for name in Settings.__dataclass_fields__:
        assert "--" + name.replace("_", "-") in help_text
    assert "PHASESCOPE_KV_CACHE_GIB" in help_text
