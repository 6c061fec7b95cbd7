"""Decode batch size vs measured tokens/s, bandwidth saturation and compute utilisation, next to the roofline.

For each batch size B it runs B concurrent streams (ignore_eos) against a
phasescope server, waits until the metrics window holds only steady decoding,
reads the server's live gauges, cancels the streams, and waits for the engine
to be idle again. The roofline calculator's prediction for the same batch,
on the same (measured) peaks and the served model's cost, is printed beside it.

    .venv/bin/python -m loadtests.decode_batch_sweep --batch-sizes 1,4,16,64

starts its own server (and stops it, engine processes included); with
--address and --metrics-url it measures a running one instead. Raw results go
to --output (JSON, gzipped if it ends in .gz). Traffic goes to loopback only
and every stream is bounded.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc

from phasescope.bench import EngineSettings, ServeVariant, start_phasescope
from phasescope.bench.harness import stop_on_sigterm, wait_engine_idle, write_results
from phasescope.client.client import Client, build_request
from phasescope.engine.default_model import DEFAULT_MODEL_NAME, ensure_default_model
from phasescope.telemetry.exposition import fetch_samples, sum_samples
from phasescope.telemetry.hardware.peaks import HardwarePeaks
from phasescope.telemetry.model.cost import model_cost_from_folder
from phasescope.telemetry.model.roofline import decode_step

PROMPT = "Write a long story about a lighthouse keeper."


class Streams:
    def __init__(self, address: str, count: int, max_tokens: int) -> None:
        self.received = [0] * count
        self.first = threading.Barrier(count + 1)
        self.calls: list[Any] = []
        self._clients = [Client(address, timeout_seconds=600) for _ in range(count)]
        self._threads = [threading.Thread(target=self._run, args=(i, max_tokens), daemon=True) for i in range(count)]
        for thread in self._threads:
            thread.start()

    def _run(self, index: int, max_tokens: int) -> None:
        call: Any = self._clients[index].generate_stream(
            build_request(prompt=f"{PROMPT} ({index})", max_tokens=max_tokens, ignore_eos=True)
        )
        self.calls.append(call)
        waited = False
        with contextlib.suppress(grpc.RpcError, threading.BrokenBarrierError):
            for chunk in call:
                self.received[index] += len(chunk.token_ids)
                if not waited:
                    waited = True
                    self.first.wait(600)

    def stop(self) -> None:
        for call in self.calls:
            call.cancel()
        for thread in self._threads:
            thread.join(60)
        for client in self._clients:
            client.close()


def measure_batch(address: str, metrics_url: str, batch: int, window: float, max_tokens: int) -> dict[str, Any]:
    streams = Streams(address, batch, max_tokens)
    try:
        streams.first.wait(600)
        time.sleep(window + 1.0)
        samples = fetch_samples(metrics_url)
        context = 0.0
        if streams.received:
            context = sum(streams.received) / len(streams.received)
    finally:
        streams.stop()
    wait_engine_idle(metrics_url, timeout=120, poll_seconds=0.2)
    return {
        "batch_size": batch,
        "mean_tokens_generated_per_stream": context,
        "decode_tokens_per_second": sum_samples(samples, "phasescope_tokens_per_second", phase="decode"),
        "prefill_tokens_per_second": sum_samples(samples, "phasescope_tokens_per_second", phase="prefill"),
        "memory_bandwidth_utilization": sum_samples(
            samples, "phasescope_memory_bandwidth_utilization_ratio", phase="decode"
        ),
        "compute_utilization": sum_samples(samples, "phasescope_compute_utilization_ratio", phase="decode"),
        "arithmetic_intensity_flops_per_byte": sum_samples(
            samples, "phasescope_arithmetic_intensity_flops_per_byte", phase="decode"
        ),
        "decode_batch_size_seen": sum_samples(samples, "phasescope_decode_batch_size"),
        "cost_model_agreement_flops": sum_samples(samples, "phasescope_cost_model_agreement_ratio", quantity="flops"),
        "cost_model_agreement_bytes": sum_samples(samples, "phasescope_cost_model_agreement_ratio", quantity="bytes"),
    }


def predictions(address: str, metrics_url: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    with Client(address, timeout_seconds=30) as client:
        info = client.model_info()
        prompt_tokens = len(client.tokenize(text=PROMPT + " (0)"))
    # The server runs on this machine: its model folder gives the full cost (attention term included).
    cost = model_cost_from_folder(Path(info.model_path), info.dtype, info.parameter_count)
    peaks = HardwarePeaks(
        info.hardware,
        info.peak_memory_bandwidth_bytes_per_second,
        {"served": info.peak_flops},
        info.peak_source,  # type: ignore[arg-type]  # the server reports one of the three sources
        info.hardware,
    )
    for row in rows:
        context = int(prompt_tokens + row["mean_tokens_generated_per_stream"])
        predicted = decode_step(cost, peaks, "served", row["batch_size"], context)
        row["context_length_at_scrape"] = context
        row["predicted_decode_tokens_per_second"] = predicted.decode_tokens_per_second_total
        row["predicted_memory_bandwidth_utilization"] = predicted.memory_bandwidth_utilization
        row["predicted_compute_utilization"] = predicted.compute_utilization
        row["predicted_bound"] = predicted.bound
    return {
        "model": info.model_name,
        "dtype": info.dtype,
        "device": info.device,
        "parameter_count": info.parameter_count,
        "weight_bytes": info.weight_bytes,
        "kv_cache_bytes_per_token": info.kv_cache_bytes_per_token,
        "peak_memory_bandwidth_bytes_per_second": info.peak_memory_bandwidth_bytes_per_second,
        "peak_flops": info.peak_flops,
        "peak_source": info.peak_source,
        "prompt_tokens": prompt_tokens,
    }


def main(argv: list[str] | None = None) -> int:
    stop_on_sigterm()  # the servers and engines it starts are stopped on SIGTERM too
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,4,16,64", type=lambda s: [int(b) for b in s.split(",")])
    parser.add_argument("--window", type=float, default=10.0, help="metrics window (s) the server averages over")
    parser.add_argument("--max-tokens", type=int, default=1200, help="tokens each stream may generate at most")
    parser.add_argument("--address", help="a running server's gRPC address (default: start one)")
    parser.add_argument("--metrics-url", help="with --address: its /metrics URL")
    parser.add_argument("--dtype", default="", help="served dtype for the started server (default: auto)")
    parser.add_argument("--kv-cache-gib", type=float, default=2.0)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--output", type=Path, default=Path("loadtests/results/decode_batch_sweep.json.gz"))
    parser.add_argument("--server-log", type=Path, default=Path("loadtests/results/decode_batch_sweep.server.log"))
    args = parser.parse_args(argv)
    args.server_log.parent.mkdir(parents=True, exist_ok=True)
    managed = None
    if args.address:
        if not args.metrics_url:
            parser.error("--address needs --metrics-url")
        address, metrics_url = args.address, args.metrics_url
    else:
        model = str(ensure_default_model())
        settings = EngineSettings(
            model,
            DEFAULT_MODEL_NAME,
            args.dtype or "auto",
            args.max_model_len,
            args.kv_cache_gib,
            max(args.batch_sizes),
        )
        print(f"starting a server; log: {args.server_log}", file=sys.stderr)
        managed, target = start_phasescope(
            settings, args.server_log, ServeVariant("phasescope", args=("--metrics-window-seconds", str(args.window)))
        )
        address, metrics_url = target.address, target.metrics_url or ""
    try:
        rows = []
        for batch in args.batch_sizes:
            print(f"batch {batch}: {batch} streams, window {args.window:g} s ...", file=sys.stderr, flush=True)
            rows.append(measure_batch(address, metrics_url, batch, args.window, args.max_tokens))
        setup = predictions(address, metrics_url, rows)
    finally:
        if managed is not None:
            managed.stop()
    write_results(args.output, {"setup": setup, "rows": rows}, indent=2)
    print(
        f"{setup['model']} {setup['dtype']} on {setup['device']}; peaks ({setup['peak_source']}): "
        f"{setup['peak_memory_bandwidth_bytes_per_second'] / 1e9:.1f} GB/s, {setup['peak_flops'] / 1e9:.1f} GFLOP/s"
    )
    print("tokens/s = decode tokens in window ÷ window; bandwidth = bytes read/s ÷ peak; MFU = FLOP/s ÷ peak")
    print(
        "| batch | decode tok/s | predicted | bandwidth saturation | predicted | compute utilisation | predicted "
        "| batch seen | context |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['batch_size']} | {row['decode_tokens_per_second']:.1f} | "
            f"{row['predicted_decode_tokens_per_second']:.1f} | {row['memory_bandwidth_utilization']:.1%} | "
            f"{row['predicted_memory_bandwidth_utilization']:.1%} | {row['compute_utilization']:.2%} | "
            f"{row['predicted_compute_utilization']:.2%} | {row['decode_batch_size_seen']:.1f} | "
            f"{row['context_length_at_scrape']} |"
        )
    print(f"raw results: {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
