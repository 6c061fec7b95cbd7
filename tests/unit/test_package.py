"""One package: the wheel installs `phasescope` and nothing else, and its public surface imports light."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import phasescope

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_holds_only_the_phasescope_package(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("phasescope-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/", 1)[0] for name in names}
    assert {entry for entry in top_level if not entry.endswith(".dist-info")} == {"phasescope"}
    # The generated contract, its stubs and the typing marker ship; the studies and tests do not.
    assert {"phasescope/v1/inference_pb2.py", "phasescope/v1/inference_pb2.pyi", "phasescope/py.typed"} <= set(names)
    assert "phasescope/bench/runner.py" in names
    assert not any(name.startswith(("loadtests/", "tests/")) for name in names)


def test_the_public_surface_is_the_client_the_request_builder_and_the_errors() -> None:
    from phasescope import AsyncClient, Client, InvalidRequestError, PhasescopeError, build_request

    assert issubclass(InvalidRequestError, PhasescopeError)
    request = build_request(prompt="Hello", max_tokens=4)
    assert (request.prompt, request.sampling.max_tokens) == ("Hello", 4)
    assert Client.__module__ == AsyncClient.__module__ == "phasescope.client.client"
    for name in phasescope.__all__:
        assert getattr(phasescope, name) is not None


def test_importing_a_room_does_not_load_the_clients_grpc_stubs() -> None:
    # The server's engine processes and the telemetry import phasescope.* without needing a client.
    probe = "import sys, phasescope.telemetry.request.stages; print('grpc' in sys.modules)"
    loaded = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True).stdout
    assert loaded.strip() == "False"


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="NoSuchThing"):
        getattr(phasescope, "NoSuchThing")  # noqa: B009  # a name not in the surface is what is under test
