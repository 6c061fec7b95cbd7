"""Mutual TLS and bearer tokens on a real server: strangers are refused, the right client is served."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from phasescope.client.client import Client, Credentials, build_request
from support.certs import CertificateAuthority
from support.servers import ServerProcess

TOKEN = "integration-token-3f9a"
OTHER_TOKEN = "integration-token-77c1"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("pki")
    ca = CertificateAuthority(directory, "phasescope-test-ca")
    rogue = CertificateAuthority(directory, "rogue-ca")
    server = ca.issue("server", server=True)
    client = ca.issue("client", server=False)
    stranger = rogue.issue("stranger", server=False)
    tokens = directory / "tokens"
    tokens.write_text(f"# test tokens\n{TOKEN}\n{OTHER_TOKEN}\n")
    return {
        "ca": ca.pair.cert, "server_key": server.key, "server_cert": server.cert,
        "client_key": client.key, "client_cert": client.cert,
        "stranger_key": stranger.key, "stranger_cert": stranger.cert, "tokens": tokens,
    }  # fmt: skip


@pytest.fixture(scope="module")
def secure_server(start_server: Callable[..., ServerProcess], pki: dict[str, Path]) -> ServerProcess:
    server = start_server(
        "--tls-cert-file", str(pki["server_cert"]), "--tls-key-file", str(pki["server_key"]),
        "--tls-client-ca-file", str(pki["ca"]), "--auth-tokens-file", str(pki["tokens"]),
        "--max-requests-per-client", "1",
        wait=False,
    )  # fmt: skip
    # The plaintext health probe of ServerProcess cannot talk TLS: wait with real credentials.
    with Client(server.address, timeout_seconds=2, credentials=credentials(pki)) as client:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert server.process.poll() is None, server.log_tail()
            try:
                if client.health() == "SERVING":
                    return server
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    raise TimeoutError(server.log_tail())


def credentials(pki: dict[str, Path], *, token: str | None = None, client: str | None = "client") -> Credentials:
    return Credentials(
        root_certificates=pki["ca"].read_bytes(),
        client_key=pki[f"{client}_key"].read_bytes() if client else None,
        client_certificate_chain=pki[f"{client}_cert"].read_bytes() if client else None,
        token=token,
    )


def generate(server: ServerProcess, creds: Credentials | None) -> str | grpc.StatusCode:
    with Client(server.address, timeout_seconds=30, credentials=creds) as client:
        try:
            return client.generate(build_request(prompt="hello", max_tokens=2, ignore_eos=True)).text
        except grpc.RpcError as exc:
            return exc.code()


def test_client_with_certificate_and_token_is_served(secure_server: ServerProcess, pki: dict[str, Path]) -> None:
    result = generate(secure_server, credentials(pki, token=TOKEN))
    assert isinstance(result, str)


def test_missing_or_wrong_token_is_refused(secure_server: ServerProcess, pki: dict[str, Path]) -> None:
    assert generate(secure_server, credentials(pki)) is grpc.StatusCode.UNAUTHENTICATED
    assert generate(secure_server, credentials(pki, token="guess")) is grpc.StatusCode.PERMISSION_DENIED


def test_clients_without_the_right_certificate_cannot_connect(
    secure_server: ServerProcess, pki: dict[str, Path]
) -> None:
    # No client certificate, one from another CA, or no TLS at all: the handshake fails.
    assert generate(secure_server, credentials(pki, token=TOKEN, client=None)) is grpc.StatusCode.UNAVAILABLE
    assert generate(secure_server, credentials(pki, token=TOKEN, client="stranger")) is grpc.StatusCode.UNAVAILABLE
    assert generate(secure_server, Credentials(token=TOKEN)) is grpc.StatusCode.UNAVAILABLE


def test_health_stays_open_for_probes_without_a_token(secure_server: ServerProcess, pki: dict[str, Path]) -> None:
    with Client(secure_server.address, timeout_seconds=10, credentials=credentials(pki)) as client:
        assert client.health() == "SERVING"
        with pytest.raises(grpc.RpcError) as caught:
            client.model_info()
    assert caught.value.code() is grpc.StatusCode.UNAUTHENTICATED


def test_one_caller_at_its_limit_does_not_hold_back_another(secure_server: ServerProcess, pki: dict[str, Path]) -> None:
    rejected_before = secure_server.sample_sum("phasescope_requests_rejected_total", reason="client_limit")
    with (
        Client(secure_server.address, timeout_seconds=120, credentials=credentials(pki, token=TOKEN)) as one,
        Client(secure_server.address, timeout_seconds=120, credentials=credentials(pki, token=OTHER_TOKEN)) as two,
    ):
        long = one.generate_stream(build_request(prompt="A long story:", max_tokens=1500, ignore_eos=True))
        next(long)  # the caller's one request is in flight
        with pytest.raises(grpc.RpcError) as caught:
            one.generate(build_request(prompt="And another", max_tokens=2, ignore_eos=True))
        assert caught.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "at its limit of 1 requests in flight" in (caught.value.details() or "")
        # Another caller (another token, the same certificate) is served meanwhile.
        assert two.generate(build_request(prompt="Me too", max_tokens=2, ignore_eos=True)).usage.completion_tokens == 2
        long.cancel()  # type: ignore[attr-defined]  # the call object is also a grpc.Future
        # Once its request has ended, the first caller is served again.
        deadline = time.monotonic() + 30
        while secure_server.sample_sum("phasescope_requests_in_flight") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert one.generate(build_request(prompt="Now me", max_tokens=2, ignore_eos=True)).usage.completion_tokens == 2
    assert secure_server.sample_sum("phasescope_requests_rejected_total", reason="client_limit") == rejected_before + 1


def test_watching_telemetry_obeys_the_same_tls_and_tokens(secure_server: ServerProcess, pki: dict[str, Path]) -> None:
    from phasescope.v1 import inference_pb2 as pb

    request = pb.WatchTelemetryRequest(interval_seconds=0.25)
    with Client(secure_server.address, timeout_seconds=30, credentials=credentials(pki, token=TOKEN)) as ok:
        snapshots = ok.watch_telemetry(request)
        snapshot = next(snapshots)
        snapshots.cancel()  # type: ignore[attr-defined]  # the call object is also a grpc.Future
    assert snapshot.engines
    anonymous = Client(secure_server.address, timeout_seconds=30, credentials=credentials(pki))
    with anonymous, pytest.raises(grpc.RpcError) as caught:
        next(anonymous.watch_telemetry(request))
    assert caught.value.code() is grpc.StatusCode.UNAUTHENTICATED


def test_phasescope_top_once_over_mutual_tls_with_a_token(
    secure_server: ServerProcess, pki: dict[str, Path], tmp_path: Path
) -> None:
    import subprocess
    import sys

    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    tls = ["--ca-file", str(pki["ca"]), "--client-cert", str(pki["client_cert"])]
    tls += ["--client-key", str(pki["client_key"])]
    command = [sys.executable, "-m", "phasescope", "top", "--address", secure_server.address, *tls, "--once"]
    served = subprocess.run([*command, "--token-file", str(token_file)], capture_output=True, text=True, timeout=120)
    assert served.returncode == 0, served.stderr
    assert "engine 0" in served.stdout
    # Without the token: one line and exit 2, as the other client commands.
    refused = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2
    assert refused.stderr.strip().count("\n") == 0
    assert "UNAUTHENTICATED" in refused.stderr
