"""`phasescope top` without vLLM: frames of hand-built snapshots as plain text, the sparkline history, the
sort orders, the small-terminal degradation, and `--once`, `--record` and `--replay` through the CLI
against an in-process gRPC server that streams the same hand-built snapshot (the network is the boundary)."""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from phasescope.cli.main import main
from phasescope.cli.top import (
    ReplaySource,
    Screen,
    Waiting,
    read_recording,
    recording_line,
    retry_after_seconds,
)
from phasescope.client.top_view import (
    SPARKLINE_WIDTH,
    Detail,
    SortKey,
    TokenRateHistory,
    ViewOptions,
    fit_detail,
    render_text,
    sort_requests,
    sparkline,
)
from phasescope.v1 import inference_pb2 as pb
from support.certs import CertificateAuthority

T0 = 1_700_000_000.0
TOKEN = "top-test-token"


def request(
    request_id: str, age: float, tokens: int, rate: float, extra: float, stalled: float = 0.0
) -> pb.RequestSnapshot:
    return pb.RequestSnapshot(
        request_id=request_id, phase="decode", age_seconds=age, prompt_tokens=37, completion_tokens=tokens,
        tokens_per_second=rate, decode_stalled_by_prefill_seconds=stalled,
        decode_prefill_interference_seconds=extra,
    )  # fmt: skip


def snapshot(*, at: float = T0, has_cost: bool = True, decode_rate: float = 11.15) -> pb.TelemetrySnapshot:
    """One engine decoding for one stream on this project's CPU VM, as README's verdict section reads it."""
    return pb.TelemetrySnapshot(
        time_unix_seconds=at, window_seconds=5.0, model_name="SmolLM2-135M-Instruct", uptime_seconds=3723.4,
        device="cpu",
        peaks=pb.Peaks(memory_bandwidth_bytes_per_second=13.7e9, flops_per_second=54.6e9, dtype="float32",
                       source="measured", hardware="AMD EPYC 7B13", ridge_point_flops_per_byte=3.99),
        engines=[pb.EngineSnapshot(
            engine=0,
            phases=[
                pb.PhaseSnapshot(phase="prefill", verdict="idle", ran=False),
                pb.PhaseSnapshot(phase="decode", tokens_per_second=decode_rate, memory_bandwidth_utilization=0.441,
                                 compute_utilization=0.0031, arithmetic_intensity=1.9, batch_size=1.0,
                                 verdict="host", host_overhead=0.545,
                                 cost_per_million_tokens=2.49 if has_cost else 0.0, ran=True),
            ],
            memory_bandwidth_utilization=0.441, compute_utilization=0.0031, compute_idle=0.9969, busy_ratio=0.83,
            running=3, waiting=1, kv_cache_usage=0.012, queue_wait_ratio=0.02, headroom=0.449,
            headroom_limit="bandwidth", idle_cost_per_hour=0.094 if has_cost else 0.0, has_cost=has_cost,
        )],
        admission=pb.AdmissionSnapshot(in_flight=4, capacity=64, rejected_in_interval=2),
        latency=pb.LatencySnapshot(
            time_to_first_token_p50_seconds=0.287, time_to_first_token_p99_seconds=0.31,
            time_to_first_token_samples=3, inter_token_p50_seconds=0.0897, inter_token_p99_seconds=0.12,
            inter_token_samples=240, queue_mean_seconds=0.0001, prefill_mean_seconds=0.279, decode_mean_seconds=3.01,
        ),
        requests_in_flight=4,
        requests=[
            request("req-old", age=9.0, tokens=90, rate=10.0, extra=0.0),
            request("req-fast", age=4.0, tokens=60, rate=14.0, extra=0.1, stalled=0.2),
            request("req-hit", age=6.0, tokens=40, rate=8.0, extra=0.25, stalled=0.44),
            request("req-new", age=1.0, tokens=5, rate=9.0, extra=0.0),
        ],
    )  # fmt: skip


def frame(
    snap: pb.TelemetrySnapshot | None = None, width: int = 120, height: int | None = None, **options: object
) -> str:
    snap = snap or snapshot()
    history = TokenRateHistory()
    history.add(snap)
    return render_text(snap, history, ViewOptions(**options), width, height)  # type: ignore[arg-type]  # test shorthand


def line_with(text: str, needle: str) -> str:
    matches = [line for line in text.splitlines() if needle in line]
    assert matches, f"no line with {needle!r} in:\n{text}"
    return matches[0]


def request_ids(text: str) -> list[str]:
    return [line.split()[0] for line in text.splitlines() if line.startswith("req-")]


def test_header_names_model_device_peaks_uptime_window_and_admission() -> None:
    text = frame()
    title = line_with(text, "phasescope top")
    assert "SmolLM2-135M-Instruct on cpu" in title
    assert "up 1h02m03s" in title
    assert "window 5.0 s" in title
    assert line_with(text, "peaks").startswith(
        "peaks 13.7 GB/s · 54.6 GFLOP/s float32 · ridge 3.99 FLOP/byte · measured (AMD EPYC 7B13)"
    )
    assert "in flight 4/64 · rejected 2 in the last interval" in line_with(text, "admission")


def test_engine_rows_show_saturation_bars_verdict_rate_overhead_headroom_and_queue() -> None:
    text = frame()
    engine = line_with(text, "engine 0")
    assert "busy 83.0%" in engine
    assert "headroom 44.9% (bandwidth)" in engine
    assert "running 3 · waiting 1 · KV cache 1.2% · queue wait 2.0%" in line_with(text, "queue  running")
    decode = line_with(text, "decode  ")
    # Bandwidth 44.1 % fills 4 of 10 cells; MFU 0.3 % none.
    assert "████░░░░░░  44.1%" in decode
    assert "░░░░░░░░░░   0.3%" in decode
    assert decode.split()[5:8] == ["host", "11.2", "█"]  # verdict, tok/s, the sparkline's one point
    assert "54.5%" in decode
    prefill = line_with(text, "prefill  ")
    assert prefill.split()[:4] == ["prefill", "—", "—", "idle"]  # a phase that ran no step has no bars


def test_the_memory_line_shows_the_kv_cache_and_who_waits_for_it() -> None:
    snap = snapshot()
    engine = snap.engines[0]
    assert "memory KV" not in frame(snap)  # a server that reports no capacity has no such line
    engine.kv_cache_capacity_tokens, engine.kv_cache_tokens, engine.kv_cache_sequences_fit = 2048, 1900, 2.7
    engine.waiting, engine.waiting_for_kv_cache, engine.kv_cache_wait_ratio = 5, 5, 0.62
    engine.preemptions_in_window = 1
    engine.phases[1].verdict = "capacity"
    text = frame(snap)
    memory = line_with(text, "memory KV")
    assert "KV 1,900/2,048 tokens · fits 3 seq" in memory
    assert "waiting for KV 5, for a slot 0 · KV wait 62.0% · preempted 1" in memory
    assert line_with(text, "decode  ").split()[5] == "capacity"


def test_with_adapters_the_view_has_an_adapter_table_and_the_engine_says_who_waits_for_a_slot() -> None:
    snap = snapshot()
    assert "adapters" not in frame(snap)  # nothing runs with an adapter: no table
    snap.adapters.extend([
        pb.AdapterSnapshot(adapter="base", in_flight=1, decoding=1, tokens_per_second=11.2),
        pb.AdapterSnapshot(adapter="sql", in_flight=3, decoding=2, tokens_per_second=20.5),
    ])  # fmt: skip
    snap.engines[0].waiting_for_adapters = 2
    text = frame(snap)
    assert line_with(text, "sql").split() == ["sql", "3", "2", "20.5"]
    assert line_with(text, "base ").split() == ["base", "1", "1", "11.2"]
    assert "waiting for an adapter slot 2" in line_with(text, "adapters waiting")


def test_a_speculating_engine_has_a_line_with_its_acceptance_and_tokens_per_verify_step() -> None:
    snap = snapshot()
    assert "speculation" not in frame(snap)  # no drafts verified in the window: no line
    engine = snap.engines[0]
    engine.speculative_acceptance_rate, engine.speculative_mean_acceptance_length = 0.6, 2.8
    assert "speculation accepted 60.0% of drafts · 2.80 tokens per verify step" in line_with(frame(snap), "speculation")


def test_the_speculation_line_says_whether_it_pays_and_why_not() -> None:
    snap = snapshot()
    engine = snap.engines[0]
    engine.speculative_acceptance_rate, engine.speculative_mean_acceptance_length = 0.6, 2.8
    engine.speculative_gain, engine.speculative_reading = 2.1, "paying"
    assert "pays 2.10×" in line_with(frame(snap), "speculation")
    engine.speculative_gain, engine.speculative_reading = 0.8, "compute"
    assert "does not pay (0.80×: verify compute-bound)" in line_with(frame(snap), "speculation")
    engine.speculative_reading = "acceptance"
    assert "acceptance too low" in line_with(frame(snap), "speculation")


def test_latency_line_gives_quantiles_with_samples_and_phase_means() -> None:
    text = frame()
    assert "TTFT p50 287 ms p99 310 ms (3) · ITL p50 89.7 ms p99 120 ms (240)" in line_with(text, "latency")
    assert "mean queue 100 µs · prefill 279 ms · decode 3.01 s" in text
    empty = snapshot()
    empty.latency.Clear()
    assert "TTFT — · ITL —" in line_with(frame(empty), "latency")
    assert "mean queue — · prefill — · decode —" in frame(empty)  # no request ended a phase in the window
    assert "kv_transfer" not in frame()  # no KV connector moved anything
    moved = snapshot()
    moved.latency.kv_transfer_mean_seconds = 0.041
    assert "decode 3.01 s · kv_transfer 41 ms" in frame(moved)


def test_request_row_shows_phase_age_tokens_rate_and_interference() -> None:
    text = frame()
    assert "4 in flight, 4 listed · sorted by age" in line_with(text, "requests")
    row = ["req-hit", "decode", "6.0", "s", "37", "40", "8.0", "440", "ms", "250", "ms"]
    assert line_with(text, "req-hit").split() == row
    assert line_with(text, "req-old").split()[-2:] == ["0", "0"]


@pytest.mark.parametrize(
    ("key", "newest_first", "expected"),
    [
        (SortKey.AGE, False, ["req-old", "req-hit", "req-fast", "req-new"]),
        (SortKey.AGE, True, ["req-new", "req-fast", "req-hit", "req-old"]),
        (SortKey.TOKENS, False, ["req-old", "req-fast", "req-hit", "req-new"]),
        (SortKey.TOKENS_PER_SECOND, False, ["req-fast", "req-old", "req-new", "req-hit"]),
        # Most extra decode time from others' prefill first; ties (none) oldest first.
        (SortKey.INTERFERENCE, False, ["req-hit", "req-fast", "req-old", "req-new"]),
    ],
)
def test_request_table_sorts_by_the_chosen_key(key: SortKey, newest_first: bool, expected: list[str]) -> None:
    assert [r.request_id for r in sort_requests(snapshot().requests, key, newest_first=newest_first)] == expected
    text = frame(sort_key=key, newest_first=newest_first)
    assert request_ids(text) == expected
    assert f"sorted by {key.value}" in text


def test_sort_key_cycles_through_all_keys_back_to_age() -> None:
    keys = [SortKey.AGE]
    for _ in SortKey:
        keys.append(keys[-1].next())
    assert keys == [SortKey.AGE, SortKey.TOKENS, SortKey.TOKENS_PER_SECOND, SortKey.INTERFERENCE, SortKey.AGE]


def test_cost_is_shown_only_when_the_server_has_a_price() -> None:
    priced = frame(snapshot(has_cost=True))
    assert "$/M tokens" in priced
    assert line_with(priced, "decode  ").rstrip().endswith("2.49")
    assert "idle cost $0.094/h" in line_with(priced, "engine 0")
    unpriced = frame(snapshot(has_cost=False))
    assert "$/M tokens" not in unpriced
    assert "idle cost" not in unpriced


def test_plain_text_has_no_escapes_and_no_line_wider_than_asked() -> None:
    for width in (120, 100, 80, 60, 40):
        text = frame(width=width)
        assert "\x1b" not in text
        assert max(len(line) for line in text.splitlines()) <= width


def test_a_small_terminal_drops_sparklines_then_cost_then_request_rows() -> None:
    snap = snapshot()
    history = TokenRateHistory()
    history.add(snap)
    options = ViewOptions()
    assert fit_detail(snap, history, options, 120, 50) == Detail()
    assert fit_detail(snap, history, options, 100, 50) == Detail(sparklines=False)
    assert fit_detail(snap, history, options, 90, 50) == Detail(sparklines=False, cost=False)
    full_height = len(frame(width=120).splitlines())
    # Two lines short at 120 columns: no sparklines, no cost, and fewer request rows, the rest counted.
    short = fit_detail(snap, history, options, 120, full_height - 2)
    assert short.sparklines is False
    assert short.cost is False
    assert short.request_rows is not None
    assert short.request_rows < 4
    text = frame(width=120, height=full_height - 2)
    assert len(text.splitlines()) <= full_height - 2
    assert "last minute" not in text
    assert "$/M tokens" not in text
    assert len(request_ids(text)) == short.request_rows
    assert f"… {4 - short.request_rows} more" in text


def test_a_tiny_terminal_still_renders_the_header() -> None:
    text = frame(width=30, height=5)
    assert "phasescope top" in text


def test_pause_and_status_lines_appear_under_the_header() -> None:
    text = frame(paused=True, status="server unavailable — reconnecting in 4 s")
    lines = text.splitlines()
    assert lines[3].startswith("PAUSED")
    assert lines[4] == "server unavailable — reconnecting in 4 s"


def test_sparkline_fills_from_the_right_and_scales_to_the_largest_rate() -> None:
    points = [(T0 + i, float(i)) for i in range(60)]
    line = sparkline(points, T0 + 59, 60.0, 20)
    assert len(line) == 20
    assert line[0] == "▁"
    assert line[-1] == "█"
    assert list(line) == sorted(line)  # a rising rate draws a rising line
    assert sparkline([(T0, 5.0)], T0, 60.0, 20) == " " * 19 + "█"
    assert sparkline([(T0, 0.0)], T0, 60.0, 4) == "   ▁"


def test_history_keeps_the_last_minute_per_engine_phase() -> None:
    history = TokenRateHistory()
    for second in range(90):
        history.add(snapshot(at=T0 + second, decode_rate=float(second)))
    points = history.points(0, "decode")
    assert points[0] == (T0 + 29, 29.0)
    assert points[-1] == (T0 + 89, 89.0)
    assert len(history.sparkline(0, "decode")) == SPARKLINE_WIDTH
    assert history.sparkline(0, "decode").endswith("█")
    assert [rate for _, rate in history.points(0, "prefill")] == [0.0] * 61


def test_history_restarts_when_time_goes_backwards() -> None:
    history = TokenRateHistory()
    history.add(snapshot(at=T0 + 10))
    history.add(snapshot(at=T0))
    assert history.points(0, "decode") == [(T0, 11.15)]


def test_reconnect_backs_off_and_refusals_do_not_retry() -> None:
    assert [retry_after_seconds(grpc.StatusCode.UNAVAILABLE, attempt) for attempt in range(7)] == [
        1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0,
    ]  # fmt: skip
    assert retry_after_seconds(None, 0) == 1.0  # the server ended the stream (draining)
    assert retry_after_seconds(grpc.StatusCode.RESOURCE_EXHAUSTED, 0) == 15.0
    for code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNIMPLEMENTED):
        assert retry_after_seconds(code, 0) is None


def test_screen_counts_down_to_the_reconnect_and_keeps_receiving_while_paused() -> None:
    screen = Screen(newest_first=False, first_status="connecting to here …")
    assert screen.status(0.0) == "connecting to here …"
    screen.waiting = Waiting("server unavailable", retry_at_monotonic=100.0)
    assert screen.status(96.5) == "server unavailable — reconnecting in 4 s"
    first, second = snapshot(at=T0), snapshot(at=T0 + 1, decode_rate=20.0)
    screen.receive(first)
    assert screen.status(96.5) == ""
    screen.toggle_pause()
    screen.receive(second)
    assert screen.shown is first
    assert screen.history.latest_unix_seconds == T0 + 1  # received, not drawn
    screen.toggle_pause()
    screen.receive(snapshot(at=T0 + 2))
    assert screen.shown is not first


def test_recording_is_one_json_line_per_snapshot_with_proto_field_names(tmp_path: Path) -> None:
    path = tmp_path / "top.jsonl"
    path.write_text(recording_line(snapshot(at=T0)) + recording_line(snapshot(at=T0 + 1)))
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    assert '"time_unix_seconds": 1700000000.0' in lines[0]
    assert list(read_recording(path)) == [snapshot(at=T0), snapshot(at=T0 + 1)]


def test_replay_plays_snapshots_in_order_at_the_recorded_pace_then_says_it_ended(tmp_path: Path) -> None:
    path = tmp_path / "top.jsonl"
    path.write_text("".join(recording_line(snapshot(at=T0 + second)) for second in range(3)))
    events: queue.Queue[object] = queue.Queue()
    source = ReplaySource(path, speed=20.0, events=events)  # type: ignore[arg-type]  # any event goes
    started = time.monotonic()
    source.start()
    received = [events.get(timeout=5) for _ in range(4)]
    elapsed = time.monotonic() - started
    source.stop()
    assert [event.time_unix_seconds for event in received[:3]] == [T0, T0 + 1, T0 + 2]  # type: ignore[attr-defined]
    assert isinstance(received[3], Waiting)
    assert "end of the recording" in received[3].message
    assert elapsed >= 2 / 20.0  # two one-second gaps at 20 ×


class _Watch:
    """WatchTelemetry only: streams the hand-built snapshot to a caller with a token; refuses others."""

    def __init__(self) -> None:
        self.requests: list[pb.WatchTelemetryRequest] = []

    def __call__(
        self, request: pb.WatchTelemetryRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.TelemetrySnapshot]:
        self.requests.append(request)
        if "authorization" not in dict(context.invocation_metadata()):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing bearer token")
        yield snapshot()


def serve_watch(server_credentials: grpc.ServerCredentials | None = None) -> tuple[grpc.Server, str, _Watch]:
    servicer = _Watch()
    handler = grpc.unary_stream_rpc_method_handler(
        servicer,
        request_deserializer=pb.WatchTelemetryRequest.FromString,
        response_serializer=pb.TelemetrySnapshot.SerializeToString,
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("phasescope.v1.Inference", {"WatchTelemetry": handler}),)
    )
    if server_credentials is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("127.0.0.1:0", server_credentials)
    server.start()
    return server, f"127.0.0.1:{port}", servicer


@pytest.fixture
def watch_server() -> Iterator[tuple[str, _Watch]]:
    server, address, servicer = serve_watch()
    yield address, servicer
    server.stop(grace=None)


def test_replay_once_prints_the_same_frame_as_live_once(
    watch_server: tuple[str, _Watch], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    address, servicer = watch_server
    token_file, recording = tmp_path / "token", tmp_path / "top.jsonl"
    token_file.write_text(TOKEN + "\n")
    argv = ["top", "--once", "--width", "100", "--interval", "0.5", "--max-requests", "7", "--newest-first"]
    assert main([*argv, "--address", address, "--token-file", str(token_file), "--record", str(recording)]) == 0
    live = capsys.readouterr().out
    assert servicer.requests == [
        pb.WatchTelemetryRequest(interval_seconds=0.5, max_requests=7, request_order=pb.REQUEST_ORDER_NEWEST_FIRST)
    ]
    assert list(read_recording(recording)) == [snapshot()]
    assert main(["top", "--once", "--width", "100", "--newest-first", "--replay", str(recording)]) == 0
    assert capsys.readouterr().out == live
    assert "phasescope top · SmolLM2-135M-Instruct on cpu" in live
    assert "p pause" not in live  # no key help in a printed frame
    assert max(len(line) for line in live.splitlines()) <= 100


def test_once_without_credentials_exits_2_with_one_line(
    watch_server: tuple[str, _Watch], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("PHASESCOPE_TOKEN", raising=False)
    assert main(["top", "--once", "--address", watch_server[0]]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip() == "phasescope top: UNAUTHENTICATED: missing bearer token"


def test_replay_of_a_file_that_is_not_a_recording_exits_2_naming_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "top.jsonl"
    path.write_text(recording_line(snapshot()).replace("model_name", "modelname"))
    assert main(["top", "--once", "--replay", str(path)]) == 2
    assert f"{path}:1: not a TelemetrySnapshot" in capsys.readouterr().err


def test_once_works_over_mutual_tls_with_a_token(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ca = CertificateAuthority(tmp_path, "top-test-ca")
    server_pair, client_pair = ca.issue("server", server=True), ca.issue("client", server=False)
    server_credentials = grpc.ssl_server_credentials(
        [(server_pair.key.read_bytes(), server_pair.cert.read_bytes())],
        root_certificates=ca.pair.cert.read_bytes(),
        require_client_auth=True,
    )
    server, address, servicer = serve_watch(server_credentials)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    try:
        argv = ["top", "--once", "--address", address, "--ca-file", str(ca.pair.cert), "--token-file", str(token_file)]
        assert main([*argv, "--client-cert", str(client_pair.cert), "--client-key", str(client_pair.key)]) == 0
    finally:
        server.stop(grace=None)
    assert "phasescope top · SmolLM2-135M-Instruct on cpu" in capsys.readouterr().out
    assert len(servicer.requests) == 1


def test_live_view_refused_by_the_server_exits_2_with_one_line(
    watch_server: tuple[str, _Watch], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("PHASESCOPE_TOKEN", raising=False)
    assert main(["top", "--address", watch_server[0]]) == 2
    assert capsys.readouterr().err == "phasescope top: UNAUTHENTICATED: missing bearer token\n"
