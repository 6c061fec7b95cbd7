"""Two engine cores behind one front end (--data-parallel-size 2), and what happens when one dies."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import grpc
import psutil
import pytest

from phasescope.client.client import build_request
from support.servers import ServerProcess


@pytest.fixture(scope="module")
def dp_server(start_server: Callable[..., ServerProcess]) -> ServerProcess:
    # vLLM's own binding, which gives each rank a core (one mask, as support.servers.engine_cpus sets, has one rank's).
    return start_server("--data-parallel-size", "2", env={"VLLM_CPU_OMP_THREADS_BIND": "auto"})


def test_concurrent_requests_are_answered_correctly_by_both_engines(dp_server: ServerProcess) -> None:
    answers: list[str] = []
    errors: list[BaseException] = []

    def ask() -> None:
        try:
            with dp_server.client() as client:
                request = build_request(
                    chat=[("user", "What is the capital of France?")], temperature=0.0, max_tokens=16
                )
                answers.append(client.generate(request).text)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert len(answers) == 8
    assert all("Paris" in answer for answer in answers)
    # Both engine cores did part of the work, and say so on /metrics.
    for engine in ("0", "1"):
        assert dp_server.sample_sum("vllm:generation_tokens_total", engine=engine) > 0, engine
    assert dp_server.sample_sum("phasescope_request_phase_seconds_count", phase="decode") >= 8
    # Each engine core reports its own steps, under its own `engine` label, from inside the core: every step its
    # scheduler ran went through phasescope's hook there, and none was dropped on its way to the hub.
    dp_server.wait_engine_idle()
    for engine in ("0", "1"):
        assert dp_server.sample_sum("phasescope_engine_step_tokens_total", engine=engine, phase="decode") > 0, engine
        steps = dp_server.sample_sum("phasescope_engine_steps_total", engine=engine)
        assert dp_server.sample_sum("phasescope_engine_telemetry_hook_calls_total", engine=engine) >= steps > 0
        assert dp_server.sample_sum("phasescope_engine_telemetry_dropped_reports_total", engine=engine) == 0


def test_health_and_model_info_report_both_engines(dp_server: ServerProcess) -> None:
    assert dp_server.health() == "SERVING"
    with dp_server.client() as client:
        assert client.model_info().data_parallel_size == 2


def engine_cores(server: ServerProcess) -> list[psutil.Process]:
    children = psutil.Process(server.process.pid).children(recursive=True)
    return [child for child in children if "EngineCore" in " ".join(child.cmdline()) or "EngineCore" in child.name()]


def test_dead_engine_core_fails_streams_unavailable_and_the_server_exits(dp_server: ServerProcess) -> None:
    cores = engine_cores(dp_server)
    assert len(cores) == 2
    errors: list[grpc.RpcError] = []
    streaming = [threading.Event(), threading.Event()]

    def stream(index: int) -> None:
        # Read on without waiting for the other stream: one held back at a barrier could see its request end in the
        # engine (2,000 tokens) while the other waited for its first token on a busy core.
        with dp_server.client() as client:
            call = client.generate_stream(build_request(prompt="Keep talking.", max_tokens=2000, ignore_eos=True))
            try:
                for _ in call:
                    streaming[index].set()
            except grpc.RpcError as exc:
                errors.append(exc)

    threads = [threading.Thread(target=stream, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for event in streaming:
        assert event.wait(120), "a stream never got its first token"
    cores[0].kill()
    for thread in threads:
        thread.join(120)
    assert len(errors) == 2
    assert all(error.code() is grpc.StatusCode.UNAVAILABLE for error in errors), [e.details() for e in errors]
    assert all("the engine died" in (error.details() or "") for error in errors), [e.details() for e in errors]
    deadline = time.monotonic() + 30
    while dp_server.process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    # The server said it could not serve and exited non-zero, leaving no engine behind.
    assert dp_server.process.poll() == 1
    # The log names the requests the engine ran when it died (their ids: an operator finds them in vLLM's dump).
    assert "Requests in the engine when it died (2)" in dp_server.log_path.read_text(errors="replace")
    assert not [core for core in cores if core.is_running() and core.status() != psutil.STATUS_ZOMBIE]
