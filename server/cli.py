"""`phasescope`: serve, generate, tokenize, info, prepare-model."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from server.config import SettingsError, add_settings_arguments, settings_from

logger = logging.getLogger("phasescope")

DEFAULT_ADDRESS = "127.0.0.1:50051"


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def _credentials(args: argparse.Namespace) -> Any:
    from pathlib import Path

    from server.client import Credentials
    from server.config import env_client_token

    token = Path(args.token_file).read_text().strip() if args.token_file else env_client_token()
    return Credentials(
        root_certificates=Path(args.ca_file).read_bytes() if args.ca_file else None,
        client_key=Path(args.client_key).read_bytes() if args.client_key else None,
        client_certificate_chain=Path(args.client_cert).read_bytes() if args.client_cert else None,
        token=token or None,
    )


def _cmd_serve(args: argparse.Namespace) -> int:
    try:
        settings = settings_from(args)
    except SettingsError as exc:
        print(f"phasescope serve: {exc}", file=sys.stderr)
        return 2
    _configure_logging(settings.log_level)
    # gRPC's C core prints INFO lines at shutdown unless told otherwise.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    from server.vllm_engine import configure_engine_logging

    configure_engine_logging(settings.engine_log_level)
    from server.app import serve

    return serve(settings)


def _cmd_prepare_model(args: argparse.Namespace) -> int:
    _configure_logging("info")
    from server.default_model import DefaultModelError, ensure_default_model

    try:
        print(ensure_default_model())
    except DefaultModelError as exc:
        print(f"phasescope prepare-model: {exc}", file=sys.stderr)
        return 1
    return 0


def _format_timings(response_timings: object) -> str:
    from phasescope.v1 import inference_pb2 as pb

    assert isinstance(response_timings, pb.Timings)
    t = response_timings
    return (
        f"frontend {t.frontend_seconds * 1e3:.1f} ms | intake {t.intake_seconds * 1e3:.1f} ms | "
        f"queue {t.queue_seconds * 1e3:.1f} ms | prefill {t.prefill_seconds * 1e3:.1f} ms | "
        f"decode {t.decode_seconds * 1e3:.1f} ms | TTFT {t.time_to_first_token_seconds * 1e3:.1f} ms | "
        f"e2e {t.e2e_seconds * 1e3:.1f} ms | TPOT {t.mean_inter_token_seconds * 1e3:.1f} ms | "
        f"decode {t.decode_tokens_per_second:.1f} tok/s"
    )


def _cmd_generate(args: argparse.Namespace) -> int:
    import grpc

    from phasescope.v1 import inference_pb2 as pb
    from server.client import PhasescopeClient, build_request, new_traceparent

    sampling: dict[str, Any] = {"max_tokens": args.max_tokens, "ignore_eos": args.ignore_eos}
    for name in ("temperature", "top_p", "top_k", "seed"):
        if getattr(args, name) is not None:
            sampling[name] = getattr(args, name)
    if args.chat:
        request = build_request(chat=[("user", args.text)], **sampling)
    else:
        request = build_request(prompt=args.text, **sampling)
    try:
        with PhasescopeClient(args.address, timeout_seconds=args.timeout, credentials=_credentials(args)) as client:
            last: pb.GenerateStreamResponse | None = None
            traceparent, trace_id = new_traceparent()
            for chunk in client.generate_stream(request, traceparent=traceparent):
                print(chunk.text, end="", flush=True)
                last = chunk
    except grpc.RpcError as exc:
        print(f"\nphasescope generate: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    print()
    if last is not None:
        reason = pb.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_").lower()
        print(
            f"[{last.usage.prompt_tokens} prompt + {last.usage.completion_tokens} output tokens, finished: {reason}]",
            file=sys.stderr,
        )
        print(f"[{_format_timings(last.timings)}]", file=sys.stderr)
        print(f"[trace id {trace_id}]", file=sys.stderr)
    return 0


def _cmd_tokenize(args: argparse.Namespace) -> int:
    import grpc

    from server.client import PhasescopeClient

    try:
        with PhasescopeClient(args.address, timeout_seconds=args.timeout, credentials=_credentials(args)) as client:
            ids = client.tokenize(chat=[("user", args.text)]) if args.chat else client.tokenize(text=args.text)
    except grpc.RpcError as exc:
        print(f"phasescope tokenize: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    print(f"{len(ids)} tokens: {ids}")
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    import grpc
    from google.protobuf import text_format

    from server.client import PhasescopeClient

    try:
        with PhasescopeClient(args.address, timeout_seconds=args.timeout, credentials=_credentials(args)) as client:
            print(f"health: {client.health()}")
            print(text_format.MessageToString(client.model_info()), end="")
    except grpc.RpcError as exc:
        print(f"phasescope info: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="phasescope", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser(
        "serve",
        help="run the gRPC inference server",
        description="Run the gRPC inference server. Every flag can also be set as PHASESCOPE_<FLAG>.",
    )
    add_settings_arguments(serve)
    serve.set_defaults(func=_cmd_serve)

    prepare = commands.add_parser("prepare-model", help="convert and cache the embedded default model, then exit")
    prepare.set_defaults(func=_cmd_prepare_model)

    def client_command(name: str, help_text: str) -> argparse.ArgumentParser:
        command = commands.add_parser(name, help=help_text)
        command.add_argument("--address", default=DEFAULT_ADDRESS, help=f"server address (default {DEFAULT_ADDRESS})")
        command.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
        command.add_argument("--ca-file", help="PEM CA of the server's certificate: connect with TLS")
        command.add_argument("--client-cert", help="PEM client certificate chain, for mutual TLS")
        command.add_argument("--client-key", help="PEM key of --client-cert")
        command.add_argument(
            "--token-file", help="file holding a bearer token (default: the PHASESCOPE_TOKEN environment variable)"
        )
        return command

    generate = client_command("generate", "stream an answer to the terminal and print its phase timings")
    generate.add_argument("text", help="the prompt (or, with --chat, the user's message)")
    generate.add_argument("--chat", action="store_true", help="send TEXT as a user message through the chat template")
    generate.add_argument("--max-tokens", type=int, default=128)
    generate.add_argument("--temperature", type=float)
    generate.add_argument("--top-p", type=float)
    generate.add_argument("--top-k", type=int)
    generate.add_argument("--seed", type=int)
    generate.add_argument("--ignore-eos", action="store_true")
    generate.set_defaults(func=_cmd_generate)

    tokenize = client_command("tokenize", "print the token ids the model sees")
    tokenize.add_argument("text")
    tokenize.add_argument("--chat", action="store_true")
    tokenize.set_defaults(func=_cmd_tokenize)

    info = client_command("info", "print the server's health and model information")
    info.set_defaults(func=_cmd_info)

    from server.roofline_cli import add_hardware_arguments, add_roofline_arguments, run_hardware, run_roofline

    roofline = commands.add_parser(
        "roofline",
        help="what a model's decode and prefill can reach on a device",
        description="Decode ceilings per batch size, compute utilisation and idleness, and the batch where decode "
        "turns compute-bound, from the model's size and the device's datasheet peaks.",
    )
    add_roofline_arguments(roofline)
    roofline.set_defaults(func=run_roofline)

    bench = commands.add_parser(
        "bench",
        help="load sweeps with vLLM bench-serve results, plots, and --compare against vLLM",
        description="Seeded concurrency and Poisson-rate sweeps against phasescope (started here unless --address); "
        "--compare adds AsyncLLM in-process and vLLM's OpenAI server on the same workload.",
    )

    def run_bench(args: argparse.Namespace) -> int:
        from loadtests.bench import main as bench_main

        return bench_main(args)

    from loadtests.bench import add_arguments as add_bench_arguments

    add_bench_arguments(bench)
    bench.set_defaults(func=run_bench)

    hardware = commands.add_parser("hardware", help="measure (once, cached) this machine's memory bandwidth and FLOP/s")
    add_hardware_arguments(hardware)
    hardware.set_defaults(func=run_hardware)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
