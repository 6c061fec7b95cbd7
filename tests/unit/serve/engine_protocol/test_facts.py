import asyncio
import dataclasses
import hashlib
import io
import json
import os
import threading
import zipfile
from pathlib import Path

import pytest

from phasescope.serve.engine_protocol.facts import (
    SERVER_TYPE,
    TokenizerBundle,
    build_tokenizer_zip,
    model_info,
    server_info,
    tokenizer_chunks,
)
from support.fake_engine import ScriptedEngine

TOKENIZER_FILES = {
    "tokenizer.json": b'{"model": {"type": "BPE"}}',
    "tokenizer_config.json": b'{"bos_token": "<s>"}',
    "config.json": b'{"model_type": "llama"}',
    "chat_template.jinja": b"{{ messages }}",
    "tokenizer.model": b"\x00sentencepiece",
}
OTHER_FILES = {
    "model.safetensors": b"\x00" * 1024,
    "README.md": b"# a model",
}


@pytest.fixture
def model_folder(tmp_path: Path) -> Path:
    for name, data in {**TOKENIZER_FILES, **OTHER_FILES}.items():
        (tmp_path / name).write_bytes(data)
    (tmp_path / "nested").mkdir()
    (tmp_path / "nested" / "tokenizer.json").write_bytes(b"{}")
    return tmp_path


def test_model_info_says_generation_and_carries_the_models_ids_and_defaults() -> None:
    description = ScriptedEngine().description

    info = model_info(description)

    assert info.is_generation
    assert info.model_path == info.tokenizer_path == description.model_path
    assert info.served_model_name == description.model_name
    assert info.max_context_length == info.max_req_input_len == description.max_context_length
    assert info.vocab_size == description.vocab_size
    assert not info.supports_vision
    assert info.model_type == "llama"
    assert list(info.architectures) == ["LlamaForCausalLM"]
    assert list(info.eos_token_ids) == [2]
    assert info.bos_token_id == 1
    assert info.default_sampling_params_json == '{"temperature":0.6}'


def test_model_info_sends_zero_for_ids_the_config_does_not_declare() -> None:
    description = dataclasses.replace(ScriptedEngine().description, bos_token_id=None, pad_token_id=None)

    info = model_info(description)

    assert (info.bos_token_id, info.pad_token_id) == (0, 0)


def test_model_info_sends_empty_defaults_json_when_the_model_declares_none() -> None:
    description = dataclasses.replace(ScriptedEngine().description, sampling_defaults=())

    assert model_info(description).default_sampling_params_json == ""


def test_defaults_json_is_compact_and_sends_top_k_as_an_integer() -> None:
    defaults = (("temperature", 0.7), ("top_p", 0.8), ("top_k", 20.0), ("repetition_penalty", 1.05))
    description = dataclasses.replace(ScriptedEngine().description, sampling_defaults=defaults)

    sent = model_info(description).default_sampling_params_json

    assert sent == '{"temperature":0.7,"top_p":0.8,"top_k":20,"repetition_penalty":1.05}'
    assert isinstance(json.loads(sent)["top_k"], int)


def test_server_info_carries_the_state_and_the_engine_facts() -> None:
    description = ScriptedEngine().description

    info = server_info(
        description, active_requests=3, uptime_seconds=12.5, last_receive_timestamp=1_700_000_000.25, paused=True
    )

    assert info.server_type == SERVER_TYPE == "vllm-grpc"
    assert (info.active_requests, info.is_paused) == (3, True)
    assert (info.uptime_seconds, info.last_receive_timestamp) == (12.5, 1_700_000_000.25)
    assert info.data_parallel_size == description.data_parallel_size
    assert info.kv_cache_dtype == description.kv_cache_dtype
    assert info.block_size == 16
    assert info.model_dtype == "torch.float32"
    assert info.max_num_seqs == 4
    assert (info.kv_connector, info.kv_role, info.kv_engine_id, info.pairing_protocol) == ("", "", "", "")
    assert (info.mm_processor, info.mm_item_limits, info.mm_encoder_budget) == ("", "", 0)


def test_server_info_is_not_paused_unless_told() -> None:
    info = server_info(ScriptedEngine().description, active_requests=0, uptime_seconds=0.0, last_receive_timestamp=0.0)

    assert not info.is_paused


def test_tokenizer_zip_holds_exactly_the_tokenizer_files(model_folder: Path) -> None:
    with zipfile.ZipFile(io.BytesIO(build_tokenizer_zip(model_folder))) as archive:
        names = archive.namelist()
        contents = {name: archive.read(name) for name in names}

    assert names == sorted(TOKENIZER_FILES)
    assert contents == TOKENIZER_FILES


def test_tokenizer_zip_is_the_same_bytes_when_built_again(model_folder: Path) -> None:
    first = build_tokenizer_zip(model_folder)
    # Another timestamp and mode on a file (a later download, another umask) must not change it.
    os.utime(model_folder / "tokenizer.json", (2_000_000_000, 2_000_000_000))
    (model_folder / "tokenizer.json").chmod(0o600)

    assert build_tokenizer_zip(model_folder) == first


def test_a_folder_without_tokenizer_files_is_refused_by_name(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"\x00")

    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        build_tokenizer_zip(tmp_path)


def test_chunks_concatenate_to_the_archive_with_the_digest_on_the_last_only(model_folder: Path) -> None:
    data = build_tokenizer_zip(model_folder)
    digest = hashlib.sha256(data).hexdigest()

    chunks = list(tokenizer_chunks(data, digest, chunk_bytes=100))

    assert len(chunks) == -(-len(data) // 100)
    assert b"".join(chunk.data for chunk in chunks) == data
    assert all(len(chunk.data) <= 100 for chunk in chunks)
    assert [chunk.sha256 for chunk in chunks] == [""] * (len(chunks) - 1) + [digest]


def test_an_archive_of_exactly_one_chunk_carries_the_digest() -> None:
    chunks = list(tokenizer_chunks(b"x" * 8, "digest", chunk_bytes=8))

    assert [(chunk.data, chunk.sha256) for chunk in chunks] == [(b"x" * 8, "digest")]


def test_an_empty_archive_streams_no_chunk() -> None:
    assert list(tokenizer_chunks(b"", "digest")) == []


def test_a_chunk_size_below_one_byte_is_refused() -> None:
    with pytest.raises(ValueError, match="chunk_bytes"):
        list(tokenizer_chunks(b"data", "digest", chunk_bytes=0))


async def test_bundle_builds_once_when_asked_concurrently(tmp_path: Path) -> None:
    builds: list[Path] = []
    released = threading.Event()

    def build(folder: Path) -> bytes:
        builds.append(folder)
        # Hold the build until every caller is waiting on it.
        released.wait(timeout=5)
        return b"archive"

    bundle = TokenizerBundle(tmp_path, build=build)

    async def scenario() -> list[tuple[bytes, str]]:
        callers = [asyncio.create_task(bundle.archive()) for _ in range(5)]
        await asyncio.sleep(0.05)
        released.set()
        answers = await asyncio.gather(*callers)
        return [*answers, await bundle.archive()]

    answers = await scenario()

    assert builds == [tmp_path]
    assert answers == [(b"archive", hashlib.sha256(b"archive").hexdigest())] * 6


async def test_bundle_build_survives_a_caller_that_goes_away(tmp_path: Path) -> None:
    builds: list[Path] = []
    released = threading.Event()

    def build(folder: Path) -> bytes:
        builds.append(folder)
        released.wait(timeout=5)
        return b"archive"

    bundle = TokenizerBundle(tmp_path, build=build)

    async def scenario() -> tuple[bytes, str]:
        leaver = asyncio.create_task(bundle.archive())
        stayer = asyncio.create_task(bundle.archive())
        await asyncio.sleep(0.05)
        leaver.cancel()
        released.set()
        return await stayer

    assert (await scenario())[0] == b"archive"
    assert builds == [tmp_path]


async def test_bundle_retries_after_a_failed_build(tmp_path: Path) -> None:
    bundle = TokenizerBundle(tmp_path)

    async def scenario() -> tuple[bytes, str]:
        with pytest.raises(FileNotFoundError):
            await bundle.archive()
        (tmp_path / "tokenizer.json").write_bytes(b"{}")
        return await bundle.archive()

    data, digest = await scenario()

    assert digest == hashlib.sha256(data).hexdigest()
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        assert archive.namelist() == ["tokenizer.json"]
