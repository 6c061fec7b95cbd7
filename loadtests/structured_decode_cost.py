"""What a structured output's grammar costs the engine per decode step: the same batch with and without a schema.

For each batch size B and each mode (plain, json_schema) it keeps B streams decoding
(each one asks again when it ends, so the batch holds), waits until the metrics window
holds only steady decoding, and reads two scrapes a window apart: decode tokens/s, the
mean decode step (engine busy seconds ÷ decode steps), the batch the steps carried, the
host overhead the server reports for decode (1 − the roofline's step time ÷ the measured
step time), the engine's busy ratio, and the mean inter-token gap. vLLM fills each
step's grammar mask on the engine core while the worker runs the forward pass, applies
it when sampling (inside the step), and advances each grammar by its new token after the
step: a cost inside the step raises the host overhead, one outside it lowers the busy
ratio and lengthens the gap between tokens.

    .venv/bin/python -m loadtests.structured_decode_cost --batch-sizes 1,8 --repeats 3

starts its own server on the default model (and stops it, engine processes included).
With --grammar-only it times, in this process and with no engine, the grammar work alone
as vLLM's xgrammar backend does it for one decode step of B sequences: filling each
sequence's mask, applying the masks to a batch of logits, and advancing each grammar by
the token drawn (on the default model's tokenizer and vocabulary).
Raw results go to --output (JSON, gzipped if it ends in .gz). Traffic goes to loopback
only and every stream is bounded.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc

from phasescope.bench import EngineSettings, start_phasescope
from phasescope.bench.harness import stop_on_sigterm, wait_engine_idle, write_results
from phasescope.client.client import Client, build_request
from phasescope.engine.default_model import DEFAULT_MODEL_NAME, ensure_default_model
from phasescope.telemetry.exposition import Samples, fetch_samples, sum_samples
from phasescope.v1 import inference_pb2 as pb

PROMPT = "List the names of every street you know, as a JSON array of strings."
# Never forced to end: one more string always fits, so the grammar stays in play for every token.
SCHEMA = json.dumps({"type": "array", "items": {"type": "string", "maxLength": 40}})
MODES = ("plain", "json_schema")


class Streams:
    """B streams that each ask again when their request ends, until stopped."""

    def __init__(self, address: str, count: int, max_tokens: int, mode: str) -> None:
        self._stop = threading.Event()
        self.first = threading.Barrier(count + 1)
        self.errors: list[BaseException] = []
        self._calls: dict[int, Any] = {}
        self._clients = [Client(address, timeout_seconds=600) for _ in range(count)]
        structured = pb.StructuredOutput(json_schema=SCHEMA) if mode == "json_schema" else None
        self._request = build_request(
            chat=[("user", PROMPT)], max_tokens=max_tokens, ignore_eos=True, temperature=0.8, structured=structured
        )
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(count)]
        for thread in self._threads:
            thread.start()

    def _run(self, index: int) -> None:
        waited = False
        while not self._stop.is_set():
            call: Any = self._clients[index].generate_stream(self._request)
            self._calls[index] = call
            try:
                for _ in call:
                    if not waited:
                        waited = True
                        with contextlib.suppress(threading.BrokenBarrierError):
                            self.first.wait(600)
            except grpc.RpcError as exc:
                if not self._stop.is_set():
                    self.errors.append(exc)
                    return

    def stop(self) -> None:
        self._stop.set()
        for call in list(self._calls.values()):
            call.cancel()
        for thread in self._threads:
            thread.join(60)
        for client in self._clients:
            client.close()


def delta(after: Samples, before: Samples, name: str, **labels: str) -> float:
    return sum_samples(after, name, **labels) - sum_samples(before, name, **labels)


def measure(address: str, metrics_url: str, batch: int, mode: str, window: float, max_tokens: int) -> dict[str, Any]:
    streams = Streams(address, batch, max_tokens, mode)
    try:
        streams.first.wait(600)
        time.sleep(window + 1.0)  # the gauges' window holds steady decoding only
        start, started = fetch_samples(metrics_url), time.monotonic()
        time.sleep(window)
        end, ended = fetch_samples(metrics_url), time.monotonic()
    finally:
        streams.stop()
    if streams.errors:
        raise RuntimeError(f"{mode} at batch {batch}: {streams.errors[0]}")
    wait_engine_idle(metrics_url, timeout=120, poll_seconds=0.2)
    steps = delta(end, start, "phasescope_engine_steps_total", kind="decode")
    busy = delta(end, start, "phasescope_engine_busy_seconds_total", phase="decode")
    gaps = delta(end, start, "phasescope_inter_token_latency_seconds_count")
    return {
        "batch_size": batch,
        "mode": mode,
        "seconds": ended - started,
        "decode_tokens_per_second": delta(end, start, "phasescope_tokens_total", phase="decode") / (ended - started),
        "decode_steps": steps,
        "mean_decode_step_seconds": busy / steps if steps else None,
        "decode_batch_size_seen": delta(end, start, "phasescope_engine_step_tokens_total", phase="decode") / steps
        if steps
        else None,
        "mixed_steps": delta(end, start, "phasescope_engine_steps_total", kind="mixed"),
        "mean_inter_token_seconds": delta(end, start, "phasescope_inter_token_latency_seconds_sum") / gaps
        if gaps
        else None,
        "host_overhead_ratio": sum_samples(end, "phasescope_host_overhead_ratio", phase="decode"),
        "engine_busy_ratio": sum_samples(end, "phasescope_engine_busy_ratio"),
    }


def grammar_step_cost(batch_sizes: list[int], steps: int, repeats: int) -> list[dict[str, Any]]:
    """Seconds per decode step of each part of the grammar's work, for B sequences under SCHEMA."""
    import torch
    import xgrammar as xgr
    from transformers import AutoConfig, AutoTokenizer

    folder = ensure_default_model()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    vocab = AutoConfig.from_pretrained(folder).vocab_size
    # As vLLM's backend builds them (backend_xgrammar.py): the model's vocabulary, a cached compiler.
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab), max_threads=8)
    grammar = compiler.compile_json_schema(SCHEMA)
    generator = torch.Generator().manual_seed(0)
    rows = []
    for repeat in range(repeats):
        for batch in batch_sizes:
            matchers = [xgr.GrammarMatcher(grammar) for _ in range(batch)]
            bitmask = xgr.allocate_token_bitmask(batch, vocab)
            fill = apply = advance = 0.0
            for _ in range(steps):
                logits = torch.randn(batch, vocab, generator=generator)
                started = time.perf_counter()
                for index, matcher in enumerate(matchers):
                    matcher.fill_next_token_bitmask(bitmask, index)
                filled = time.perf_counter()
                xgr.apply_token_bitmask_inplace(logits, bitmask)
                applied = time.perf_counter()
                tokens = logits.argmax(dim=-1).tolist()
                chosen = time.perf_counter()
                for matcher, token in zip(matchers, tokens, strict=True):
                    if not matcher.accept_token(token) or matcher.is_terminated():
                        matcher.reset()
                advanced = time.perf_counter()
                fill += filled - started
                apply += applied - filled
                advance += advanced - chosen
            rows.append(
                {
                    "repeat": repeat,
                    "batch_size": batch,
                    "steps": steps,
                    "fill_seconds_per_step": fill / steps,
                    "apply_seconds_per_step": apply / steps,
                    "advance_seconds_per_step": advance / steps,
                }
            )
    return rows


def median_row(rows: list[dict[str, Any]], batch: int, mode: str, key: str) -> float:
    values = [row[key] for row in rows if row["batch_size"] == batch and row["mode"] == mode and row[key] is not None]
    return statistics.median(values) if values else float("nan")


def main(argv: list[str] | None = None) -> int:
    stop_on_sigterm()  # the servers and engines it starts are stopped on SIGTERM too
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,8", type=lambda s: [int(b) for b in s.split(",")])
    parser.add_argument("--repeats", type=int, default=3, help="runs of each batch and mode, interleaved")
    parser.add_argument("--window", type=float, default=10.0, help="metrics window (s) the server averages over")
    parser.add_argument("--max-tokens", type=int, default=400, help="tokens each request may generate at most")
    parser.add_argument(
        "--grammar-only", action="store_true", help="time the grammar's own work per decode step, with no engine"
    )
    parser.add_argument("--steps", type=int, default=200, help="with --grammar-only: decode steps timed per run")
    parser.add_argument("--output", type=Path, default=Path("loadtests/results/structured_decode_cost.json.gz"))
    parser.add_argument("--server-log", type=Path, default=Path("loadtests/results/structured_decode_cost.server.log"))
    args = parser.parse_args(argv)
    args.server_log.parent.mkdir(parents=True, exist_ok=True)
    if args.grammar_only:
        grammar_rows = grammar_step_cost(args.batch_sizes, args.steps, args.repeats)
        write_results(args.output, {"schema": SCHEMA, "rows": grammar_rows}, indent=2)
        print(f"grammar work per decode step, medians of {args.repeats} runs of {args.steps} steps")
        print("| batch | fill masks | apply masks | advance grammars | total | per sequence |")
        print("|---:|---:|---:|---:|---:|---:|")
        for batch in args.batch_sizes:
            parts = [
                statistics.median(row[key] for row in grammar_rows if row["batch_size"] == batch)
                for key in ("fill_seconds_per_step", "apply_seconds_per_step", "advance_seconds_per_step")
            ]
            cells = " | ".join(f"{part * 1e3:.3f} ms" for part in parts)
            print(f"| {batch} | {cells} | {sum(parts) * 1e3:.3f} ms | {sum(parts) / batch * 1e6:.0f} µs |")
        print(f"raw results: {args.output}", file=sys.stderr)
        return 0
    settings = EngineSettings(str(ensure_default_model()), DEFAULT_MODEL_NAME, "auto", 2048, 2.0, max(args.batch_sizes))
    print(f"starting a server; log: {args.server_log}", file=sys.stderr)
    managed, target = start_phasescope(settings, args.server_log, ("--metrics-window-seconds", str(args.window)))
    rows: list[dict[str, Any]] = []
    try:
        address, metrics_url = target.address, target.metrics_url or ""
        with Client(address, timeout_seconds=120) as client:
            info = client.model_info()
            # The schema's grammar compiled once before any measurement (a new schema waits for it).
            client.generate(build_request(prompt="[", max_tokens=2, structured=pb.StructuredOutput(json_schema=SCHEMA)))
        for repeat in range(args.repeats):
            for batch in args.batch_sizes:
                for mode in MODES:
                    print(f"repeat {repeat + 1}: batch {batch}, {mode} ...", file=sys.stderr, flush=True)
                    rows.append(
                        {"repeat": repeat, **measure(address, metrics_url, batch, mode, args.window, args.max_tokens)}
                    )
    finally:
        managed.stop()
    setup = {"model": info.model_name, "dtype": info.dtype, "device": info.device, "schema": SCHEMA}
    write_results(args.output, {"setup": setup, "rows": rows}, indent=2)
    print(
        f"{info.model_name} {info.dtype} on {info.device}; medians of {args.repeats} runs, each over {args.window:g} s"
    )
    print("| batch | mode | decode tok/s | decode step | batch seen | host overhead | busy ratio | inter-token gap |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for batch in args.batch_sizes:
        for mode in MODES:

            def m(key: str, batch: int = batch, mode: str = mode) -> float:
                return median_row(rows, batch, mode, key)

            print(
                f"| {batch} | {mode} | {m('decode_tokens_per_second'):.1f} | "
                f"{m('mean_decode_step_seconds') * 1e3:.2f} ms | {m('decode_batch_size_seen'):.2f} | "
                f"{m('host_overhead_ratio'):.1%} | {m('engine_busy_ratio'):.1%} | "
                f"{m('mean_inter_token_seconds') * 1e3:.2f} ms |"
            )
    print(f"raw results: {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
