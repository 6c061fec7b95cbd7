"""`phasescope generate`: stream an answer to the terminal and print its phase timings."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from phasescope.cli.connection import add_client_parser, credentials

if TYPE_CHECKING:
    from phasescope.cli import Subparsers
    from phasescope.v1 import inference_pb2 as pb


def add_cli_args(subparsers: Subparsers) -> argparse.ArgumentParser:
    parser = add_client_parser(subparsers, "generate", "stream an answer to the terminal and print its phase timings")
    parser.add_argument("text", help="the prompt (or, with --chat, the user's message)")
    parser.add_argument("--chat", action="store_true", help="send TEXT as a user message through the chat template")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--min-tokens", type=int, help="no end of sequence or stop before this many tokens")
    parser.add_argument(
        "--n",
        type=int,
        metavar="N",
        help="draw N samples for the prompt (needs sampling: a temperature above 0); each is printed when it ends",
    )
    parser.add_argument(
        "--logprobs",
        type=int,
        metavar="N",
        help="print each token's log probability and its N likeliest alternatives after the answer",
    )
    constraint = parser.add_mutually_exclusive_group()
    constraint.add_argument(
        "--json-schema", type=Path, metavar="FILE", help="answer with JSON that validates against the schema in FILE"
    )
    constraint.add_argument("--regex", help="answer with text that matches this regular expression")
    constraint.add_argument(
        "--choice", action="append", metavar="TEXT", help="answer with exactly one of these (repeat for each)"
    )
    parser.add_argument(
        "--token-ids-only",
        action="store_true",
        help="ask for token ids without text (the engine skips detokenising); prints the ids",
    )
    return parser


def format_logprob(entry: pb.TokenLogprob) -> str:
    """`token logprob | alternative logprob, ...` for one output token."""
    line = f"{entry.token_id:>7} {entry.logprob:8.4f}"
    alternatives = ", ".join(f"{top.token_id} {top.logprob:.4f}" for top in entry.top)
    return f"{line} | {alternatives}" if alternatives else line


def format_timings(t: pb.Timings) -> str:
    # Imported here: it loads the generated messages, which `phasescope --help` does without.
    from phasescope.serve.timings import TIMED_STAGES

    # A stage inside another (kv_transfer) only where the request had it.
    stages = [
        f"{stage.name} {getattr(t, stage.seconds_field) * 1e3:.1f} ms"
        for stage in TIMED_STAGES
        if not stage.nested or getattr(t, stage.seconds_field)
    ]
    if t.kv_loaded_tokens or t.kv_saved_tokens:
        stages.append(f"KV loaded {t.kv_loaded_tokens} saved {t.kv_saved_tokens} tokens")
    return " | ".join(
        [
            *stages,
            f"TTFT {t.time_to_first_token_seconds * 1e3:.1f} ms",
            f"e2e {t.e2e_seconds * 1e3:.1f} ms",
            f"TPOT {t.mean_inter_token_seconds * 1e3:.1f} ms",
            f"decode {t.decode_tokens_per_second:.1f} tok/s",
        ]
    )


class UsageError(Exception):
    """A flag's value that cannot be sent (the message says why)."""


def sampling_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """SamplingParams' fields from the flags; UsageError for a schema file that cannot be read."""
    from phasescope.v1 import inference_pb2 as pb

    sampling: dict[str, Any] = {"max_tokens": args.max_tokens, "ignore_eos": args.ignore_eos}
    for name in ("temperature", "top_p", "top_k", "seed", "min_tokens", "logprobs", "n"):
        if getattr(args, name) is not None:
            sampling[name] = getattr(args, name)
    if args.json_schema is not None:
        try:
            schema = args.json_schema.read_text(encoding="utf-8")
        except OSError as exc:
            raise UsageError(f"--json-schema: cannot read {args.json_schema}: {exc.strerror}") from exc
        # The server checks it too; here the error names the file.
        try:
            json.loads(schema)
        except ValueError as exc:
            raise UsageError(f"--json-schema: {args.json_schema} is not JSON: {exc}") from exc
        sampling["structured"] = pb.StructuredOutput(json_schema=schema)
    elif args.regex is not None:
        sampling["structured"] = pb.StructuredOutput(regex=args.regex)
    elif args.choice:
        sampling["structured"] = pb.StructuredOutput(choice=pb.Choice(choices=args.choice))
    return sampling


def cmd(args: argparse.Namespace) -> int:
    import grpc

    from phasescope.client.client import Client, build_request, new_traceparent

    try:
        sampling = sampling_from_args(args)
    except UsageError as exc:
        print(f"phasescope generate: {exc}", file=sys.stderr)
        return 2
    text: dict[str, Any] = {"chat": [("user", args.text)]} if args.chat else {"prompt": args.text}
    request = build_request(**text, token_ids_only=args.token_ids_only, **sampling)
    samples = (args.n or 1) > 1
    try:
        with Client(args.address, timeout_seconds=args.timeout, credentials=credentials(args)) as client:
            last: pb.GenerateStreamResponse | None = None
            logprobs: list[pb.TokenLogprob] = []
            # With --n: each sample's chunks, printed together once the sample ends (they interleave).
            pending: dict[int, list[pb.GenerateStreamResponse]] = {}
            traceparent, trace_id = new_traceparent()
            for chunk in client.generate_stream(request, traceparent=traceparent):
                last = chunk
                if samples:
                    pending.setdefault(chunk.index, []).append(chunk)
                    if chunk.HasField("timings"):
                        print_sample(chunk.index, pending.pop(chunk.index), args.token_ids_only)
                    continue
                logprobs.extend(chunk.logprobs)
                if args.token_ids_only:
                    print(" ".join(map(str, chunk.token_ids)), end=" " if chunk.token_ids else "", flush=True)
                else:
                    print(chunk.text, end="", flush=True)
    except grpc.RpcError as exc:
        print(f"\nphasescope generate: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    if not samples:
        print()
    for entry in logprobs:
        print(format_logprob(entry), file=sys.stderr)
    if last is not None:
        usage = f"{last.usage.prompt_tokens} prompt + {last.usage.completion_tokens} output tokens"
        if samples:
            print(f"[{usage}, {args.n} samples]", file=sys.stderr)
        else:
            print(f"[{usage}, finished: {_reason(last)}]", file=sys.stderr)
            print(f"[{format_timings(last.timings)}]", file=sys.stderr)
        print(f"[trace id {trace_id}]", file=sys.stderr)
    return 0


def _reason(chunk: pb.GenerateStreamResponse) -> str:
    from phasescope.v1 import inference_pb2 as pb

    return pb.FinishReason.Name(chunk.finish_reason).removeprefix("FINISH_REASON_").lower()


def print_sample(index: int, chunks: list[pb.GenerateStreamResponse], token_ids_only: bool) -> None:
    """One ended sample: its answer, then (on stderr) its log probabilities, finish and its own timings."""
    if token_ids_only:
        answer = " ".join(str(token) for chunk in chunks for token in chunk.token_ids)
    else:
        answer = "".join(chunk.text for chunk in chunks)
    print(f"--- sample {index} ---\n{answer}", flush=True)
    for chunk in chunks:
        for entry in chunk.logprobs:
            print(format_logprob(entry), file=sys.stderr)
    last = chunks[-1]
    print(f"[sample {index} finished: {_reason(last)}]", file=sys.stderr)
    print(f"[{format_timings(last.timings)}]", file=sys.stderr)
