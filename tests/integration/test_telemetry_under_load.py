"""The figures stay true where operators look at them: overload, chunked prefill, long generations.

Each test drives the real engine into the regime and compares what phasescope
exports with what the clients saw and with vLLM's own series.
"""

from __future__ import annotations

import random
import threading
import time

import grpc
import pytest

from phasescope.client.client import build_request
from phasescope.telemetry.exposition import Samples, sum_samples
from support.servers import WINDOW_SECONDS, ServerProcess

IDLE = {"running": 0, "waiting": 0, "in_flight": 0}


def distinct_prompt(length: int, seed: int) -> list[int]:
    """Token ids no other request shares, so the prefix cache computes every one."""
    rng = random.Random(seed)
    return [rng.randrange(1_000, 40_000) for _ in range(length)]


def delta(after: Samples, before: Samples, name: str, **labels: str) -> float:
    return sum_samples(after, name, **labels) - sum_samples(before, name, **labels)


def ttft_slo_misses(samples: Samples, threshold: str = "2.0") -> float:
    """The PhasescopeTTFTSLOBurn expression's numerator, as a count: late first tokens + none at all."""
    late = sum_samples(samples, "phasescope_time_to_first_token_seconds_count") - sum_samples(
        samples, "phasescope_time_to_first_token_seconds_bucket", le=threshold
    )
    return late + sum_samples(samples, "phasescope_requests_without_first_token_total")


def test_requests_that_die_mid_prefill_are_observed_and_miss_the_ttft_slo(server: ServerProcess) -> None:
    assert server.wait_engine_idle() == IDLE
    before = server.samples()
    n = 3
    # A 300-token prompt takes the engine well over a second to prefill on a CPU: a 0.3 s
    # deadline ends each request before its first token, in the queue or mid-prefill. The channel is
    # connected first, so that no deadline runs out before its request reaches the server.
    codes = []
    with server.client() as client:
        client.model_info()
        for index in range(n):
            request = build_request(token_ids=distinct_prompt(300, seed=index), max_tokens=4)
            with pytest.raises(grpc.RpcError) as caught:
                client.generate(request, deadline_seconds=0.3)
            codes.append(caught.value.code())
    assert codes == [grpc.StatusCode.DEADLINE_EXCEEDED] * n
    # The engine core finishes a step it began before it sees an abort, and reports the step
    # then. It runs requests in order, so once a later request is answered every step of the
    # abandoned ones has been reported.
    barrier = [7, 8, 9, 10, 11]
    with server.client() as client:
        client.generate(build_request(token_ids=barrier, max_tokens=1))
    assert server.wait_engine_idle(timeout=60) == IDLE
    after = server.samples()

    assert delta(after, before, "phasescope_requests_without_first_token_total", code="DEADLINE_EXCEEDED") == n
    assert delta(after, before, "phasescope_requests_total", code="DEADLINE_EXCEEDED", finish_reason="abort") == n
    # The TTFT SLO counts each as a miss, though none has a TTFT.
    assert ttft_slo_misses(after) - ttft_slo_misses(before) == n
    assert delta(after, before, "phasescope_time_to_first_token_seconds_count") == 1  # the barrier
    # Their time before the first token is observed: the frontend stage and, since the engine
    # stamps nothing before a first token, queue and prefill together as "abandoned".
    assert delta(after, before, "phasescope_request_phase_seconds_count", phase="frontend") == n + 1  # and the barrier
    assert delta(after, before, "phasescope_request_phase_seconds_count", phase="abandoned") == n
    # Each waited out most of its 0.3 s deadline in the engine (token ids need no tokenising).
    assert delta(after, before, "phasescope_request_phase_seconds_bucket", phase="abandoned", le="0.1") == 0
    # Prompts never answered are not counted as prefill tokens, exactly as vLLM counts them...
    prefill_tokens = delta(after, before, "phasescope_tokens_total", phase="prefill")
    assert prefill_tokens == delta(after, before, "vllm:prompt_tokens_total")
    # ...while the chunk the engine did compute for the first (the others died queued behind
    # it) is in the step series, beside the barrier's prompt.
    assert delta(after, before, "phasescope_engine_step_tokens_total", phase="prefill") >= 300 + len(barrier)


class DecodingStreams:
    """Streams that decode in the background until stopped (each cancelled at the end)."""

    def __init__(self, server: ServerProcess, count: int) -> None:
        self._stop = threading.Event()
        self._started = threading.Barrier(count + 1)
        self.errors: list[BaseException] = []
        self._threads = [threading.Thread(target=self._run, args=(server, index)) for index in range(count)]
        for thread in self._threads:
            thread.start()
        self._started.wait(120)

    def _run(self, server: ServerProcess, index: int) -> None:
        first = True
        try:
            with server.client() as client:
                stream = client.generate_stream(
                    build_request(prompt=f"Essay {index}:", max_tokens=1_500, ignore_eos=True)
                )
                for _ in stream:
                    if first:
                        first = False
                        self._started.wait(120)
                    if self._stop.is_set():
                        stream.cancel()  # type: ignore[attr-defined]  # the call object is also a grpc.Future
                        break
        except BaseException as exc:
            self.errors.append(exc)
            if first:
                self._started.abort()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)


def decode_intensity(after: Samples, before: Samples) -> float:
    flops = delta(after, before, "phasescope_model_flops_total", phase="decode")
    moved = delta(after, before, "phasescope_model_read_bytes_total", phase="decode") + delta(
        after, before, "phasescope_model_written_bytes_total", phase="decode"
    )
    return flops / moved


# Today's prompts and ones four times as long: the chunk's attention grows with its square, and decode
# must not be charged any of it.
@pytest.mark.parametrize("prompt_tokens", [250, 1000])
def test_decode_operating_point_holds_while_prompts_keep_arriving(server: ServerProcess, prompt_tokens: int) -> None:
    assert server.wait_engine_idle() == IDLE
    decoders = DecodingStreams(server, 4)
    try:
        # Decode only, four sequences, for longer than the gauges' window.
        start = server.samples()
        time.sleep(WINDOW_SECONDS + 0.5)
        decode_only = server.samples()
        # The same four decoding while long prompts arrive back to back: chunked prefill
        # schedules each beside the decodes, in mixed steps.
        with server.client() as client:
            for index in range(3):
                prompt = distinct_prompt(prompt_tokens, seed=prompt_tokens + index)
                client.generate(build_request(token_ids=prompt, max_tokens=1))
        # The last prompt's step reaches the series a moment after its answer (its report crosses from the hub's
        # thread to the event loop): read once it has, while the four still decode.
        deadline = time.monotonic() + 10
        mixed = server.samples()
        while delta(mixed, decode_only, "phasescope_engine_steps_total", kind="mixed") < 3:
            assert time.monotonic() < deadline, "three prompts beside the decodes ran fewer than three mixed steps"
            time.sleep(0.05)
            mixed = server.samples()
    finally:
        decoders.stop()
    assert not decoders.errors
    assert server.wait_engine_idle(timeout=60) == IDLE
    assert delta(mixed, decode_only, "phasescope_engine_steps_total", kind="mixed") >= 3
    assert delta(decode_only, start, "phasescope_engine_steps_total", kind="mixed") == 0
    # A window of decode only: prefill ran no step, so it has no operating point (absent, not
    # "100 % idle"); the device's figures are decode's.
    assert not any(
        name == "phasescope_memory_bandwidth_utilization_ratio" and ("phase", "prefill") in labels
        for name, labels in decode_only
    )
    assert sum_samples(decode_only, "phasescope_device_memory_bandwidth_utilization_ratio", engine="0") == (
        pytest.approx(sum_samples(decode_only, "phasescope_memory_bandwidth_utilization_ratio", phase="decode"))
    )
    # Decode is charged what a decode-only step of its batch moves and computes: its intensity does
    # not jump towards the prompts'. Measured here: alone 1.962 FLOP/byte; beside 250-token prompts
    # 1.959, beside 1,000-token ones 1.971 (1.997 and 2.088 when the engine's FLOPs were split in the
    # cost model's proportion; 3.54 by the token-share split before that).
    alone, beside = decode_intensity(decode_only, start), decode_intensity(mixed, decode_only)
    assert beside == pytest.approx(alone, rel=0.15)
    # The device holds both phases: at least each phase's part.
    device = sum_samples(mixed, "phasescope_device_memory_bandwidth_utilization_ratio", engine="0")
    for phase in ("prefill", "decode"):
        assert (
            device >= sum_samples(mixed, "phasescope_memory_bandwidth_utilization_ratio", engine="0", phase=phase) > 0
        )
    # Inter-token latencies are the engine's own: the same gaps vLLM counts.
    end = server.samples()
    assert delta(end, start, "phasescope_inter_token_latency_seconds_count") == delta(
        end, start, "vllm:inter_token_latency_seconds_count"
    )
    assert delta(end, start, "phasescope_inter_token_latency_seconds_sum") == pytest.approx(
        delta(end, start, "vllm:inter_token_latency_seconds_sum"), rel=1e-6
    )
    assert delta(end, start, "phasescope_tokens_total", phase="decode") == delta(
        end, start, "vllm:generation_tokens_total"
    )


def test_a_long_generation_is_counted_while_it_streams(server: ServerProcess) -> None:
    assert server.wait_engine_idle() == IDLE
    before = server.samples()
    with server.client() as client:
        stream = client.generate_stream(build_request(prompt="A long tale:", max_tokens=1_000, ignore_eos=True))
        received = 0
        for chunk in stream:
            received += len(chunk.token_ids)
            if received >= 8:
                break
        during = server.samples()
        stream.cancel()  # type: ignore[attr-defined]  # the call object is also a grpc.Future
    # Long before its end: its first token's stages are observed and its tokens counted.
    assert delta(during, before, "phasescope_time_to_first_token_seconds_count") == 1
    assert delta(during, before, "phasescope_client_time_to_first_token_seconds_count") == 1
    assert delta(during, before, "phasescope_request_phase_seconds_count", phase="prefill") == 1
    assert delta(during, before, "phasescope_tokens_total", phase="decode") >= received
    assert delta(during, before, "phasescope_request_phase_seconds_count", phase="decode") == 0
    assert server.wait_engine_idle(timeout=10) == IDLE


def test_timings_start_at_handler_entry_and_tile_to_the_end(server: ServerProcess) -> None:
    with server.client() as client:
        chunks = list(client.generate_stream(build_request(chat=[("user", "Name a colour.")], max_tokens=6)))
    t = chunks[-1].timings
    assert t.frontend_seconds > 0
    assert t.intake_seconds > 0
    # frontend + intake + queue + prefill + decode = last token − handler entry = E2E, on one clock.
    before_first_token = t.frontend_seconds + t.intake_seconds + t.queue_seconds + t.prefill_seconds
    assert before_first_token + t.decode_seconds == pytest.approx(t.e2e_seconds, abs=1e-6)
    assert t.time_to_first_token_seconds == pytest.approx(before_first_token, abs=1e-6)
    # The client's first chunk is written after the engine produced its token.
    assert t.client_time_to_first_token_seconds >= t.time_to_first_token_seconds


def decode_timings_beside(server: ServerProcess, prompt_length: int, seed: int) -> tuple[float, float]:
    """(stalled, extra) seconds of one decoding stream's timings while two prompts of `prompt_length`
    tokens arrive during its decode (none with `prompt_length` 0)."""
    with server.client() as client:
        stream = client.generate_stream(build_request(prompt="Count slowly:", max_tokens=32, ignore_eos=True))
        last = None
        for chunk in stream:
            if last is None and prompt_length:
                # Its first token is out: the prompts arrive while it decodes, one after another,
                # and chunked prefill schedules each beside its decode.
                with server.client() as other:
                    for index in range(2):
                        prompt = distinct_prompt(prompt_length, seed=seed + index)
                        other.generate(build_request(token_ids=prompt, max_tokens=1))
            last = chunk
    assert last is not None
    assert last.HasField("timings")
    return last.timings.decode_stalled_by_prefill_seconds, last.timings.decode_prefill_interference_seconds


def test_prefill_interference_grows_with_the_prompts_injected_beside_a_decode(server: ServerProcess) -> None:
    assert server.wait_engine_idle() == IDLE
    before = server.samples()
    alone = decode_timings_beside(server, 0, seed=0)
    short = decode_timings_beside(server, 32, seed=300)
    long = decode_timings_beside(server, 600, seed=400)
    assert server.wait_engine_idle(timeout=60) == IDLE
    # A stream that decodes alone shares no step with a prefill chunk.
    assert alone == (0.0, 0.0)
    # Beside prompts it spends the mixed steps' time in them, more the longer the prompts;
    # the extra those chunks cost it over a decode-only step grows with them too.
    assert 0.0 < short[0] < long[0]
    assert short[1] < long[1]
    assert long[1] > 0.0
    # Each stream's figures are observed once, on both histograms (the one-token prompts never decoded).
    after = server.samples()
    for name in ("phasescope_decode_prefill_stall_seconds", "phasescope_decode_prefill_interference_seconds"):
        assert delta(after, before, f"{name}_count") == 3
    assert delta(after, before, "phasescope_decode_prefill_stall_seconds_sum") == pytest.approx(
        short[0] + long[0], rel=1e-6
    )


def bound(samples: Samples, phase: str) -> list[str]:
    """The verdicts whose phasescope_bound series reads 1 for engine 0's phase."""
    return [
        dict(labels)["verdict"]
        for (name, labels), value in samples.items()
        if name == "phasescope_bound" and ("phase", phase) in labels and ("engine", "0") in labels and value == 1
    ]


def test_the_verdict_follows_its_evidence_on_the_real_engine(server: ServerProcess) -> None:
    assert server.wait_engine_idle() == IDLE
    time.sleep(WINDOW_SECONDS + 0.5)
    idle = server.samples()
    # Nothing ran in the window: both phases idle, no overhead figure, full headroom.
    assert bound(idle, "decode") == ["idle"]
    assert bound(idle, "prefill") == ["idle"]
    assert sum_samples(idle, "phasescope_host_overhead_ratio") == 0.0
    assert sum_samples(idle, "phasescope_headroom_ratio", engine="0") == 1.0
    decoders = DecodingStreams(server, 1)
    try:
        time.sleep(WINDOW_SECONDS + 0.5)
        busy = server.samples()
    finally:
        decoders.stop()
    assert not decoders.errors
    # One stream decoding for a whole window: one verdict, and the one its evidence gives —
    # host when the steps ran below 70 % of the roofline's speed, else the roof they sit under.
    (verdict,) = bound(busy, "decode")
    overhead = sum_samples(busy, "phasescope_host_overhead_ratio", engine="0", phase="decode")
    assert 0.0 <= overhead <= 1.0
    if overhead > 0.3:
        assert verdict == "host"
    else:
        # Batch-1 decode streams its weights: under the bandwidth roof, far left of the ridge.
        assert verdict == "memory"
    # One request, nothing waiting: no queue; headroom is below 1 by what the decode uses.
    assert sum_samples(busy, "phasescope_queue_wait_ratio", engine="0") == 0.0
    (limit,) = [dict(labels)["limit"] for name, labels in busy if name == "phasescope_headroom_ratio"]
    headroom = sum_samples(busy, "phasescope_headroom_ratio", engine="0")
    bandwidth = sum_samples(busy, "phasescope_device_memory_bandwidth_utilization_ratio", engine="0")
    if limit == "bandwidth":
        assert headroom == pytest.approx(max(0.0, 1 - bandwidth / 0.8), abs=0.05)
    assert 0.0 <= headroom < 1.0
    # The shared server's price ($2.50 an hour): the share of it that pays for idle compute is shown.
    assert any(name == "phasescope_idle_cost_per_hour" for name, _ in busy)
    assert 0.0 < sum_samples(busy, "phasescope_idle_cost_per_hour") <= 2.5
    assert server.wait_engine_idle(timeout=60) == IDLE
