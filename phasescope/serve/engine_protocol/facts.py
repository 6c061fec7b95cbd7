"""What a phasescope worker says about itself on vLLM's engine protocol: GetModelInfo, GetServerInfo
and the GetTokenizer bundle, each answered as vLLM's own servicer (smg-grpc-servicer) answers it,
so the smg gateway registers and drives a phasescope worker exactly as it does vLLM's.

Pure functions of the engine's `ModelDescription` (and of the model folder, for the tokenizer),
except `TokenizerBundle`, which keeps the one archive a worker serves.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2

from phasescope.engine.base import ModelDescription

# vLLM's Rust worker says "vllm-grpc" (and its Python worker leaves the field empty); the gateway
# does not branch on the value (the installed `smg` binary holds the string only as that worker's
# own answer), so phasescope says what vLLM's worker says and is taken for one in every respect.
SERVER_TYPE = "vllm-grpc"

# The sampling defaults the gateway parses as integers (its `SamplingDefaults.top_k` is an i32,
# and serde refuses `20.0` for one); the description keeps every default as a float.
_INTEGER_DEFAULTS = frozenset({"top_k"})

# The files the gateway's tokenizer loader reads, as smg-grpc-servicer's tokenizer_bundle lists
# them (the Rust tokenizer hub's `is_tokenizer_file()` plus the model's config files).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "tiktoken.model",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
)
TOKENIZER_GLOBS = ("*.tiktoken", "*.jinja", "*.model")

# One timestamp and one mode for every entry: the archive's bytes (and so the SHA-256 the gateway
# checks the stream against) depend on the files' contents only, not on when or with which umask
# the model was downloaded, so every replica of a model sends the same archive.
_ZIP_DATE_TIME = (1980, 1, 1, 0, 0, 0)
_ZIP_FILE_MODE = 0o644 << 16

CHUNK_BYTES = 64 * 1024
"""GetTokenizer's chunk size: vLLM's servicer's, sized to the gateway's gRPC client limits."""


def default_sampling_params_json(description: ModelDescription) -> str:
    """The generation config's sampling defaults as compact JSON, as vLLM's servicer sends them;
    empty when the model declares none."""
    if not description.sampling_defaults:
        return ""
    defaults = {
        name: int(value) if name in _INTEGER_DEFAULTS else value for name, value in description.sampling_defaults
    }
    return json.dumps(defaults, separators=(",", ":"))


def model_info(description: ModelDescription) -> vllm_engine_pb2.GetModelInfoResponse:
    """GetModelInfo's answer: the model the worker serves, every field set."""
    return vllm_engine_pb2.GetModelInfoResponse(
        # phasescope loads the tokenizer from the model folder, so both paths are that folder.
        model_path=description.model_path,
        tokenizer_path=description.model_path,
        # The gateway sends only embedding requests to a worker that says false; phasescope generates.
        is_generation=True,
        max_context_length=description.max_context_length,
        # vLLM's servicer says a prompt may be as long as the context; the gateway reads both alike.
        max_req_input_len=description.max_context_length,
        vocab_size=description.vocab_size,
        # phasescope serves text models only.
        supports_vision=False,
        served_model_name=description.model_name,
        model_type=description.model_type,
        architectures=description.architectures,
        eos_token_ids=description.eos_token_ids,
        # The fields are plain int32s: vLLM's servicer sends 0 when the config declares no id
        # (its `attr_int`), and so does phasescope, so the gateway reads both workers alike.
        bos_token_id=description.bos_token_id or 0,
        pad_token_id=description.pad_token_id or 0,
        default_sampling_params_json=default_sampling_params_json(description),
    )


def server_info(
    description: ModelDescription,
    *,
    active_requests: int,
    uptime_seconds: float,
    last_receive_timestamp: float,
    paused: bool = False,
) -> vllm_engine_pb2.GetServerInfoResponse:
    """GetServerInfo's answer: the worker's state now and the engine facts the gateway labels it with.

    With --kv-transfer-config, the KV connector, role and engine id as vLLM's worker reports them
    (a MultiConnector's one mover; the gateway chooses how it relays a pair's parameters by the
    prefill worker's connector); empty without one, as vLLM sends them. The pairing protocol and
    attention backend stay empty (the gateway reads them as unknown, not as a mismatch), and so do
    the multimodal fields: phasescope takes no media.
    """
    connector = description.kv_connector
    return vllm_engine_pb2.GetServerInfoResponse(
        active_requests=active_requests,
        is_paused=paused,
        last_receive_timestamp=last_receive_timestamp,
        uptime_seconds=uptime_seconds,
        server_type=SERVER_TYPE,
        data_parallel_size=description.data_parallel_size,
        kv_cache_dtype=description.kv_cache_dtype,
        block_size=description.kv_cache_block_size,
        # vLLM sends `str(torch_dtype)`; the description keeps the bare name.
        model_dtype=f"torch.{description.dtype}",
        max_num_seqs=description.max_num_seqs,
        kv_connector=connector.connector if connector is not None else "",
        kv_role=connector.role if connector is not None else "",
        kv_engine_id=connector.engine_id if connector is not None else "",
    )


def _tokenizer_file_names(folder: Path) -> list[str]:
    """The tokenizer files in `folder` (by name, sorted): the listed names and the globs' matches."""
    names = {name for name in TOKENIZER_FILES if (folder / name).is_file()}
    names.update(match.name for pattern in TOKENIZER_GLOBS for match in folder.glob(pattern) if match.is_file())
    return sorted(names)


def build_tokenizer_zip(folder: Path) -> bytes:
    """A ZIP of the tokenizer files in the model folder, the same bytes for the same files.

    Raises FileNotFoundError naming the folder when it holds none.
    """
    names = _tokenizer_file_names(folder)
    if not names:
        raise FileNotFoundError(
            f"no tokenizer files in {folder}: none of {', '.join(TOKENIZER_FILES + TOKENIZER_GLOBS)}"
        )
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name in names:
            entry = zipfile.ZipInfo(name, date_time=_ZIP_DATE_TIME)
            entry.compress_type = zipfile.ZIP_DEFLATED
            entry.external_attr = _ZIP_FILE_MODE
            archive.writestr(entry, (folder / name).read_bytes())
    return buffer.getvalue()


class TokenizerBundle:
    """The model folder's tokenizer archive and its SHA-256, built once and kept.

    The first `archive()` builds it in a worker thread: reading and deflating the folder takes
    hundreds of milliseconds, which on the event loop would stall every stream the worker serves.
    Callers that arrive during the build await that same build, and one that goes away does not
    cancel it for the others. The folder is the model's, fixed for the worker's life, so the
    archive is served from memory after that; a failed build is not kept, so the next call retries.
    """

    def __init__(self, folder: Path, build: Callable[[Path], bytes] = build_tokenizer_zip) -> None:
        self.folder = folder
        self._build = build
        self._archive: tuple[bytes, str] | None = None
        self._building: asyncio.Task[tuple[bytes, str]] | None = None

    async def archive(self) -> tuple[bytes, str]:
        """The archive's bytes and their SHA-256 hex digest."""
        if self._archive is not None:
            return self._archive
        if self._building is None:
            self._building = asyncio.get_running_loop().create_task(self._build_once())
        return await asyncio.shield(self._building)

    async def _build_once(self) -> tuple[bytes, str]:
        try:
            self._archive = await asyncio.to_thread(self._build_and_digest)
            return self._archive
        finally:
            self._building = None

    def _build_and_digest(self) -> tuple[bytes, str]:
        data = self._build(self.folder)
        return data, hashlib.sha256(data).hexdigest()


def tokenizer_chunks(
    data: bytes, sha256: str, chunk_bytes: int = CHUNK_BYTES
) -> Iterator[common_pb2.GetTokenizerChunk]:
    """The archive as GetTokenizerChunk messages of at most `chunk_bytes` each, in order, the
    SHA-256 on the last one only (the gateway checks the whole against it); none for an empty archive."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be at least 1, not {chunk_bytes}")
    for offset in range(0, len(data), chunk_bytes):
        end = offset + chunk_bytes
        yield common_pb2.GetTokenizerChunk(data=data[offset:end], sha256=sha256 if end >= len(data) else "")
