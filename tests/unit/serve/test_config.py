import argparse
import re
import typing
from pathlib import Path

import pytest
from pydantic import ValidationError

from phasescope.cli.main import build_parser
from phasescope.serve.config import (
    DEFAULT_EXTERNAL_HUB,
    Settings,
    SettingsError,
    add_settings_arguments,
    parse_settings,
    settings_from,
)

FIELDS = Settings.model_fields


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def env(name: str) -> str:
    return "PHASESCOPE_" + name.upper()


def literal_fields() -> list[str]:
    return [name for name, field in FIELDS.items() if typing.get_origin(field.annotation) is typing.Literal]


def listed_choices(name: str, message: str) -> list[str]:
    """The values a "--flag must be a, b or c, got ..." message lists."""
    listed = message.removeprefix(f"{flag(name)} must be ").split(", got ")[0]
    return re.split(r", | or ", listed)


def serve_help() -> str:
    parser = build_parser()
    subparsers = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    serve: argparse.ArgumentParser = subparsers.choices["serve"]
    return serve.format_help()


def test_defaults_are_the_documented_ones() -> None:
    settings = parse_settings([], environ={})
    assert settings.port == 50051
    assert settings.metrics_port == 9400
    assert settings.model == ""
    assert settings.data_parallel_size == 1
    assert (settings.dtype, settings.event_loop, settings.log_level) == ("auto", "auto", "info")
    assert (settings.max_model_len, settings.kv_cache_gib) == (None, None)
    assert (settings.enforce_eager, settings.auth_exempt_health, settings.preload_tcmalloc) == (False, True, True)
    assert settings.headroom_bandwidth == 0.8
    assert settings.effective_metrics_host == "127.0.0.1"
    # Nothing set is nothing changed: no field moves off its declared default.
    assert all(getattr(settings, name) == field.default for name, field in FIELDS.items())


def test_flag_beats_environment_which_beats_default() -> None:
    environ = {"PHASESCOPE_PORT": "6000", "PHASESCOPE_MAX_MODEL_LEN": "512", "PHASESCOPE_ENFORCE_EAGER": "true"}
    from_env = parse_settings([], environ=environ)
    assert (from_env.port, from_env.max_model_len, from_env.enforce_eager) == (6000, 512, True)
    from_flags = parse_settings(["--port", "7000", "--no-enforce-eager"], environ=environ)
    assert (from_flags.port, from_flags.max_model_len, from_flags.enforce_eager) == (7000, 512, False)
    # A field neither sets keeps its default.
    assert from_flags.metrics_port == 9400


def test_a_flag_beats_a_bad_environment_value() -> None:
    # The environment's value is never looked at once a flag sets the field.
    assert parse_settings(["--port", "7000"], environ={"PHASESCOPE_PORT": "many"}).port == 7000


def test_an_explicit_environ_is_the_only_environment_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PHASESCOPE_PORT", "6001")
    monkeypatch.setenv("PHASESCOPE_DTYPE", "int3")
    assert parse_settings([], environ={}).port == 50051
    assert parse_settings([], environ={"PHASESCOPE_PORT": "6002"}).port == 6002
    monkeypatch.delenv("PHASESCOPE_DTYPE")
    # Without one, the process environment is read.
    assert parse_settings([]).port == 6001
    assert settings_from(None).port == 6001


def test_settings_are_built_directly_from_keywords() -> None:
    settings = Settings(enforce_eager=True, max_model_len=2048, kv_cache_gib=1.0)
    options = settings.engine_options()
    assert (options.enforce_eager, options.max_model_len, options.kv_cache_gib) == (True, 2048, 1.0)
    assert options.max_num_seqs == settings.max_concurrent_requests == 64
    assert Settings(metrics_host="0.0.0.0").effective_metrics_host == "0.0.0.0"


def test_the_kv_transfer_config_reaches_the_engine_as_given_from_a_flag_or_the_environment() -> None:
    config = '{"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}'
    assert parse_settings(["--kv-transfer-config", config], environ={}).engine_options().kv_transfer_config == config
    from_env = parse_settings([], environ={"PHASESCOPE_KV_TRANSFER_CONFIG": config})
    assert from_env.engine_options().kv_transfer_config == config
    assert parse_settings([], environ={}).engine_options().kv_transfer_config == ""


def test_settings_are_frozen() -> None:
    settings = Settings()
    with pytest.raises(ValueError, match="frozen"):
        settings.port = 1


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
        (["--kv-transfer-config", '["ExampleConnector"]'], "--kv-transfer-config"),
        (["--kv-transfer-config", '{"kv_connector": '], "--kv-transfer-config"),
    ],
)
def test_bad_settings_are_refused_at_start(argv: list[str], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        parse_settings(argv, environ={})


def test_lora_modules_are_name_path_pairs_from_the_flag_or_one_variable_and_reach_the_engine() -> None:
    argv = ["--lora-modules", "sql=/adapters/sql", "chat=/adapters/chat", "--max-loras", "2"]
    options = parse_settings(argv, environ={}).engine_options()
    assert options.lora_modules == (("sql", "/adapters/sql"), ("chat", "/adapters/chat"))
    assert (options.lora, options.max_loras, options.max_lora_rank, options.max_cpu_loras) == (True, 2, 16, None)
    from_env = parse_settings([], environ={"PHASESCOPE_LORA_MODULES": "sql=/adapters/sql chat=/adapters/chat"})
    assert from_env.engine_options().lora_modules == options.lora_modules
    assert parse_settings([], environ={}).engine_options().lora is False
    assert parse_settings(["--allow-adapter-updates"], environ={}).engine_options().lora is True


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lora-modules", "sql"], "--lora-modules must be NAME=PATH pairs .* 'sql' is not one"),
        (["--lora-modules", "other=/a"], "--lora-modules must be NAME=PATH pairs whose names are adapter names: base"),
        (["--lora-modules", "a b=/a"], "an adapter name is 1 to 64 letters"),
        (["--lora-modules", "sql=/a", "sql=/b"], "'sql' is named twice"),
        (["--max-lora-rank", "7"], "--max-lora-rank must be one of 1, 8, 16, 32, 64, 128, 256, 320, 512"),
        (["--front-end", "rust", "--lora-modules", "sql=/a"], "--front-end rust: smg's Rust request path carries no"),
        (["--max-loras", "4", "--max-cpu-loras", "2"], r"--max-cpu-loras \(2\) must be at least --max-loras \(4\)"),
    ],
)
def test_bad_lora_settings_are_refused_saying_what_is_wanted(argv: list[str], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        parse_settings(argv, environ={})


def test_bad_environment_value_names_the_variable() -> None:
    with pytest.raises(SettingsError, match="PHASESCOPE_PORT"):
        parse_settings([], environ={"PHASESCOPE_PORT": "many"})


@pytest.mark.parametrize("name", literal_fields())
def test_a_wrong_choice_from_a_flag_names_the_flag_and_every_accepted_value(name: str) -> None:
    with pytest.raises(SettingsError) as refused:
        parse_settings([flag(name), "bogus"], environ={})
    message = str(refused.value)
    assert message.startswith(f"{flag(name)} must be ")
    assert message.endswith(", got 'bogus'")
    assert env(name) not in message
    assert listed_choices(name, message) == [choice or "empty" for choice in typing.get_args(FIELDS[name].annotation)]
    # Every accepted value is accepted: the message cannot list a value the type refuses.
    for choice in typing.get_args(FIELDS[name].annotation):
        assert getattr(parse_settings([flag(name), choice], environ={}), name) == choice


@pytest.mark.parametrize("name", literal_fields())
def test_a_wrong_choice_from_the_environment_names_the_flag_the_variable_and_every_accepted_value(name: str) -> None:
    with pytest.raises(SettingsError) as refused:
        parse_settings([], environ={env(name): "bogus"})
    message = str(refused.value)
    assert message.startswith(f"{flag(name)} must be ")
    assert message.endswith(f", got 'bogus' (from {env(name)})")
    assert listed_choices(name, message) == [choice or "empty" for choice in typing.get_args(FIELDS[name].annotation)]


def test_the_choices_are_the_ones_the_old_checks_accepted() -> None:
    def choices(name: str) -> set[str]:
        return set(typing.get_args(FIELDS[name].annotation))

    assert choices("dtype") == {"auto", "bfloat16", "float16", "float32", "half", "float"}
    assert choices("distributed_executor_backend") == {"", "mp", "ray", "uni"}
    assert choices("event_loop") == {"auto", "uvloop", "asyncio"}
    assert choices("log_level") == choices("engine_log_level") == {"debug", "info", "warning", "error", "critical"}


def test_the_event_loop_message_lists_its_choices_in_order() -> None:
    with pytest.raises(SettingsError, match=r"^--event-loop must be auto, uvloop or asyncio, got 'trio'$"):
        parse_settings(["--event-loop", "trio"], environ={})


def test_log_levels_are_read_case_blind() -> None:
    assert (
        parse_settings(["--log-level", "DEBUG"], environ={"PHASESCOPE_ENGINE_LOG_LEVEL": "Error"}).log_level == "debug"
    )
    assert parse_settings([], environ={"PHASESCOPE_ENGINE_LOG_LEVEL": "Error"}).engine_log_level == "error"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--port", "70000"], "--port must be in [0, 65535], got '70000'"),
        (["--metrics-port", "-1"], "--metrics-port must be in [0, 65535], got '-1'"),
        (["--max-concurrent-requests", "0"], "--max-concurrent-requests must be at least 1, got '0'"),
        (["--max-model-len", "0"], "--max-model-len must be at least 1, got '0'"),
        (["--max-queued-requests", "-1"], "--max-queued-requests must be at least 0, got '-1'"),
        (["--kv-cache-gib", "0"], "--kv-cache-gib must be more than 0, got '0'"),
        (["--peak-flops=-1e12"], "--peak-flops must be more than 0, got '-1e12'"),
        (["--headroom-compute", "0"], "--headroom-compute must be in (0, 1], got '0'"),
        (["--headroom-queue", "1.5"], "--headroom-queue must be in (0, 1], got '1.5'"),
        (["--trace-sample-ratio", "1.5"], "--trace-sample-ratio must be in [0, 1], got '1.5'"),
        (["--metrics-window-seconds", "nan"], "--metrics-window-seconds must be more than 0, got 'nan'"),
        (["--shutdown-grace-seconds", "-1"], "--shutdown-grace-seconds must be at least 0, got '-1'"),
        (["--accelerator-cost-per-hour", "-2"], "--accelerator-cost-per-hour must be at least 0, got '-2'"),
    ],
)
def test_a_bound_violated_names_the_flag_and_the_bound(argv: list[str], message: str) -> None:
    with pytest.raises(SettingsError) as refused:
        parse_settings(argv, environ={})
    assert str(refused.value) == message


def test_a_bound_violated_in_the_environment_names_the_variable() -> None:
    with pytest.raises(SettingsError) as refused:
        parse_settings([], environ={"PHASESCOPE_DATA_PARALLEL_SIZE": "0"})
    assert str(refused.value) == "--data-parallel-size must be at least 1, got '0' (from PHASESCOPE_DATA_PARALLEL_SIZE)"


def test_the_bounds_allow_their_own_ends() -> None:
    settings = parse_settings(
        ["--port", "65535", "--metrics-port", "0", "--headroom-compute", "1", "--trace-sample-ratio", "0"], environ={}
    )
    assert (settings.port, settings.metrics_port, settings.headroom_compute, settings.trace_sample_ratio) == (
        65535,
        0,
        1.0,
        0.0,
    )


def test_a_value_of_the_wrong_kind_from_a_flag_is_a_settings_error() -> None:
    # The flags do not convert: a bad value gets the model's message, not argparse's exit.
    with pytest.raises(SettingsError, match=r"^--port must be an integer, got 'many'$"):
        parse_settings(["--port", "many"], environ={})
    with pytest.raises(SettingsError, match=r"^--kv-cache-gib must be a number, got 'lots'$"):
        parse_settings(["--kv-cache-gib", "lots"], environ={})


def test_every_problem_is_one_line_naming_its_flag() -> None:
    with pytest.raises(SettingsError) as refused:
        parse_settings(["--port", "-1", "--dtype", "int3"], environ={"PHASESCOPE_MAX_WATCHERS": "-1"})
    lines = str(refused.value).splitlines()
    assert len(lines) == 3
    assert [line.split()[0] for line in lines] == ["--port", "--max-watchers", "--dtype"]
    assert "PHASESCOPE_MAX_WATCHERS" in lines[1]


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("true", True),
        ("True", True),
        ("1", True),
        ("yes", True),
        ("on", True),
        ("false", False),
        ("FALSE", False),
        ("0", False),
        ("no", False),
        ("off", False),
        ("", False),
    ],
)
def test_booleans_from_the_environment(text: str, value: bool) -> None:
    # auth_exempt_health defaults to True, so a false reading cannot be the default showing through.
    settings = parse_settings([], environ={"PHASESCOPE_ENFORCE_EAGER": text, "PHASESCOPE_AUTH_EXEMPT_HEALTH": text})
    assert (settings.enforce_eager, settings.auth_exempt_health) == (value, value)


def test_a_bad_boolean_from_the_environment_names_the_flag_and_the_accepted_words() -> None:
    with pytest.raises(SettingsError) as refused:
        parse_settings([], environ={"PHASESCOPE_ENFORCE_EAGER": "maybe"})
    message = str(refused.value)
    assert message.startswith("--enforce-eager must be true or false")
    assert "PHASESCOPE_ENFORCE_EAGER" in message


def test_an_empty_variable_leaves_an_optional_number_unset() -> None:
    settings = parse_settings([], environ={"PHASESCOPE_MAX_MODEL_LEN": "", "PHASESCOPE_KV_CACHE_GIB": ""})
    assert (settings.max_model_len, settings.kv_cache_gib) == (None, None)


def test_a_bad_value_given_in_code_is_refused_naming_the_field() -> None:
    # Code that builds Settings itself gets pydantic's own error (the command line turns it into flags' words).
    with pytest.raises(ValidationError, match=r"port\n  Input should be greater than or equal to 0"):
        Settings(port=-1)
    with pytest.raises(ValidationError, match=r"prt\n  Extra inputs are not permitted"):
        Settings(prt=1)  # type: ignore[call-arg]  # an unknown keyword is what is under test


def test_the_hardware_must_be_a_datasheet_row() -> None:
    with pytest.raises(SettingsError, match=r"^--hardware must be a device of the datasheet table \(.*h100-sxm"):
        parse_settings(["--hardware", "abacus"], environ={})
    assert parse_settings(["--hardware", "h100-sxm"], environ={}).hardware == "h100-sxm"


def test_tls_files_go_together(tmp_path: Path) -> None:
    cert = tmp_path / "server.pem"
    cert.write_text("")
    with pytest.raises(SettingsError, match="--tls-cert-file and --tls-key-file go together"):
        parse_settings(["--tls-cert-file", str(cert)], environ={})
    with pytest.raises(SettingsError, match=r"--tls-client-ca-file .* needs --tls-cert-file"):
        parse_settings(["--tls-client-ca-file", str(cert)], environ={})
    both = parse_settings(["--tls-cert-file", str(cert)], environ={"PHASESCOPE_TLS_KEY_FILE": str(cert)})
    assert both.tls_key_file == str(cert)


def test_files_that_do_not_exist_are_refused_at_start(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing.pem")
    with pytest.raises(SettingsError) as refused:
        parse_settings(["--tls-cert-file", missing], environ={"PHASESCOPE_TLS_KEY_FILE": missing})
    assert str(refused.value).splitlines() == [
        f"--tls-cert-file must be an existing file, got {missing!r}",
        f"--tls-key-file must be an existing file, got {missing!r} (from PHASESCOPE_TLS_KEY_FILE)",
    ]
    with pytest.raises(SettingsError, match=r"^--model must be an existing folder"):
        parse_settings(["--model", str(tmp_path / "no-model")], environ={})
    # A relative name may be a hub id.
    assert parse_settings(["--model", "HuggingFaceTB/SmolLM2-135M-Instruct"], environ={}).model


def test_every_setting_has_a_help_text() -> None:
    for name, field in FIELDS.items():
        assert field.description, f"{name} has no docstring"
        assert field.description.strip()


def test_serve_help_documents_every_setting() -> None:
    help_text = serve_help()
    # Every field of the one settings object is a flag: a new setting cannot be left out.
    for name in FIELDS:
        assert flag(name) in help_text
    assert "PHASESCOPE_KV_CACHE_GIB" in help_text


def test_serve_help_shows_every_field_docstring() -> None:
    # argparse rewraps the help (and breaks lines at hyphens), so compare without whitespace.
    help_text = "".join(serve_help().split())
    for name, field in FIELDS.items():
        assert field.description
        assert "".join(field.description.split()) in help_text, name
        assert f"[env{env(name)};default:{field.default!r}]".replace(" ", "") in help_text, name
    # The choices come from the Literal types.
    assert "--dtype{auto,bfloat16,float16,float32,half,float}" in help_text


def test_booleans_are_dual_flags_and_unset_flags_are_absent() -> None:
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser)
    assert vars(parser.parse_args([])) == {}
    assert vars(parser.parse_args(["--no-preload-tcmalloc", "--enforce-eager"])) == {
        "preload_tcmalloc": False,
        "enforce_eager": True,
    }
    # Values are passed on as typed, for the model to parse.
    assert vars(parser.parse_args(["--port", "7000"])) == {"port": "7000"}


def test_an_external_front_ends_hub_listens_on_a_known_loopback_port_unless_told() -> None:
    assert parse_settings(["--front-end", "external"], environ={}).effective_telemetry_listen == DEFAULT_EXTERNAL_HUB
    told = parse_settings(["--front-end", "external", "--telemetry-listen", "tcp://127.0.0.1:7000"], environ={})
    assert told.effective_telemetry_listen == "tcp://127.0.0.1:7000"
    # The engine cores phasescope starts itself are told a private address.
    assert parse_settings([], environ={}).effective_telemetry_listen == ""


def test_the_rust_front_end_refuses_what_smgs_rust_server_does_not_do(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("secret\n")
    with pytest.raises(SettingsError, match="--front-end rust: smg's Rust server does no TLS"):
        parse_settings(["--front-end", "rust", "--auth-tokens-file", str(tokens)], environ={})


def test_phasescope_v1_beside_the_rust_server_listens_next_to_it_unless_told() -> None:
    assert parse_settings(["--front-end", "rust", "--port", "7000"], environ={}).effective_v1_port == 7001
    assert parse_settings(["--front-end", "rust", "--v1-port", "7100"], environ={}).effective_v1_port == 7100
    assert parse_settings(["--front-end", "rust", "--v1-port", "0"], environ={}).effective_v1_port == 0
    # The Python front end serves phasescope.v1 on --port itself.
    assert parse_settings(["--v1-port", "7100"], environ={}).effective_v1_port == 0


def test_only_an_engine_the_server_starts_is_pinned() -> None:
    assert parse_settings(["--front-end", "rust", "--pin-front-end"], environ={}).pin_front_end
    with pytest.raises(SettingsError, match="--pin-front-end moves the engine this server starts"):
        parse_settings(["--front-end", "external", "--pin-front-end"], environ={})
