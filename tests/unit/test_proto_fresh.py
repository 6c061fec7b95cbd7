"""The committed generated code is what `make proto` produces from the .proto files."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO = ROOT / "proto"
BIN = Path(sys.executable).parent


def test_generated_protobuf_code_is_fresh(tmp_path: Path) -> None:
    sources = sorted(p.relative_to(PROTO) for p in PROTO.glob("phasescope/v1/*.proto"))
    assert sources
    subprocess.run(
        [
            sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO}",
            f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}",
            f"--mypy_out={tmp_path}", f"--mypy_grpc_out={tmp_path}",
            f"--plugin=protoc-gen-mypy={BIN / 'protoc-gen-mypy'}",
            f"--plugin=protoc-gen-mypy_grpc={BIN / 'protoc-gen-mypy_grpc'}",
            *map(str, sources),
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert generated
    stale = [str(path) for path in generated if (ROOT / path).read_bytes() != (tmp_path / path).read_bytes()]
    assert not stale, f"generated code is stale; run `make proto`: {stale}"
