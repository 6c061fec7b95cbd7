"""locust user for phasescope: GenerateStream over gRPC, timed by hand per request.

Each request fires three locust request events:
  - "TTFT (ms)": first streamed token - send;
  - "TPOT (µs)": (last token - first token) / (output tokens - 1), in microseconds,
    because locust rounds response times under 100 ms to whole milliseconds;
  - "E2E (ms)": last chunk - send;
with the output-token count as the response length. A failed request fires one
"E2E (ms)" failure carrying its gRPC status. Every request sends a fresh
W3C traceparent, so a slow request can be found by trace id.

    locust -f loadtests/locustfile.py --headless -u 4 -r 4 -t 30s --host 127.0.0.1:50051 \\
        --max-tokens 64 --csv results/locust --html results/locust.html

Workload options (flags or the PHASESCOPE_LOCUST_* environment): --prompts
(builtin or a JSONL file of {"prompt": ...} or {"messages": [...]}), --max-tokens,
--ignore-eos, --temperature, --chat, --deadline-seconds; CI gates: --max-fail-ratio,
--max-p95-ttft-ms, --max-p95-e2e-ms.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

# locust runs on gevent: grpc must cooperate with it, or every call blocks the whole
# process (the run hangs past -t). This has to happen before any channel exists.
import grpc
import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()

from locust import User, constant, events, task  # noqa: E402  # after init_gevent, as above
from locust.env import Environment  # noqa: E402  # after init_gevent, as above

from phasescope.client.client import build_request, new_traceparent  # noqa: E402  # after init_gevent, as above
from phasescope.v1 import inference_pb2_grpc as pb_grpc  # noqa: E402  # after init_gevent, as above

# Varied lengths on purpose: short questions, paragraphs, a long context.
BUILTIN_PROMPTS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about a lighthouse.",
    "List five things to pack for a hiking trip and say why each matters.",
    "Summarise the plot of a story in which a robot learns to paint, in one paragraph.",
    "You are a helpful assistant. A customer writes: 'My order arrived damaged, the box was crushed and two of "
    "the three mugs inside are broken. I would like a replacement rather than a refund, and I need it before the "
    "weekend because they are a gift.' Draft a short, polite reply that apologises, confirms the replacement and "
    "explains the next steps.",
    "Here are notes from a meeting: the team agreed to move the release to next Tuesday; QA found two blocking "
    "bugs in the payment flow; marketing needs screenshots by Friday; the database migration was rehearsed "
    "successfully on staging; support asked for a FAQ about the new pricing; the on-call rotation changes next "
    "month. Turn these notes into a list of action items with an owner role for each.",
]


def add_arguments(parser: Any) -> None:
    group = parser.add_argument_group("phasescope workload")
    group.add_argument(
        "--prompts",
        default="builtin",
        env_var="PHASESCOPE_LOCUST_PROMPTS",
        help='builtin, or a JSONL file of {"prompt": ...} or {"messages": [...]} lines',
    )
    group.add_argument("--max-tokens", type=int, default=64, env_var="PHASESCOPE_LOCUST_MAX_TOKENS")
    group.add_argument(
        "--ignore-eos",
        action="store_true",
        env_var="PHASESCOPE_LOCUST_IGNORE_EOS",
        help="always generate --max-tokens tokens",
    )
    group.add_argument("--temperature", type=float, default=0.7, env_var="PHASESCOPE_LOCUST_TEMPERATURE")
    group.add_argument(
        "--chat",
        action="store_true",
        env_var="PHASESCOPE_LOCUST_CHAT",
        help="send prompts as a user message through the chat template",
    )
    group.add_argument("--deadline-seconds", type=float, default=120.0, env_var="PHASESCOPE_LOCUST_DEADLINE")
    group.add_argument(
        "--max-fail-ratio",
        type=float,
        default=0.0,
        env_var="PHASESCOPE_LOCUST_MAX_FAIL_RATIO",
        help="exit non-zero when the failure ratio exceeds this",
    )
    group.add_argument(
        "--max-p95-ttft-ms",
        type=float,
        default=0.0,
        env_var="PHASESCOPE_LOCUST_MAX_P95_TTFT_MS",
        help="exit non-zero when p95 time to first token exceeds this (0: no bound)",
    )
    group.add_argument("--max-p95-e2e-ms", type=float, default=0.0, env_var="PHASESCOPE_LOCUST_MAX_P95_E2E_MS",
                       help="exit non-zero when p95 end-to-end latency exceeds this (0: no bound)")  # fmt: skip


# Listeners are registered by call, not as decorators: `add_listener` is untyped and would erase their types.
events.init_command_line_parser.add_listener(add_arguments)


def load_prompts(source: str) -> list[dict[str, Any]]:
    if source == "builtin":
        return [{"prompt": prompt} for prompt in BUILTIN_PROMPTS]
    prompts = [json.loads(line) for line in Path(source).read_text().splitlines() if line.strip()]
    if not prompts or not all("prompt" in p or "messages" in p for p in prompts):
        raise ValueError(f'{source}: every line needs a "prompt" or "messages" field')
    return prompts


class PhasescopeUser(User):
    """One client streaming one request after another (a closed loop)."""

    wait_time = constant(0)

    def on_start(self) -> None:
        options = self.environment.parsed_options
        host = (self.host or "127.0.0.1:50051").removeprefix("grpc://").removeprefix("http://")
        self._channel = grpc.insecure_channel(host)
        self._stub = pb_grpc.InferenceStub(self._channel)
        self._prompts = load_prompts(options.prompts)
        self._options = options

    def on_stop(self) -> None:
        self._channel.close()

    def _request(self) -> Any:
        entry = random.choice(self._prompts)
        sampling = {"max_tokens": self._options.max_tokens, "temperature": self._options.temperature,
                    "ignore_eos": self._options.ignore_eos}  # fmt: skip
        if "messages" in entry:
            turns = [(m["role"], m["content"]) for m in entry["messages"]]
            return build_request(chat=turns, **sampling)
        if self._options.chat:
            return build_request(chat=[("user", entry["prompt"])], **sampling)
        return build_request(prompt=entry["prompt"], **sampling)

    @task
    def generate_stream(self) -> None:
        fire = self.environment.events.request.fire
        traceparent, trace_id = new_traceparent()
        request = self._request()
        tokens = 0
        first = last = 0.0
        started = time.perf_counter()
        try:
            for chunk in self._stub.GenerateStream(
                request, timeout=self._options.deadline_seconds, metadata=(("traceparent", traceparent),)
            ):
                now = time.perf_counter()
                if chunk.token_ids:
                    if not tokens:
                        first = now
                    tokens += len(chunk.token_ids)
                    last = now
        except grpc.RpcError as exc:
            elapsed_ms = (time.perf_counter() - started) * 1e3
            error = RuntimeError(f"{exc.code().name}: {exc.details()} (trace {trace_id})")
            fire(request_type="grpc", name="E2E (ms)", response_time=elapsed_ms, response_length=tokens,
                 exception=error, context={"trace_id": trace_id})  # fmt: skip
            return
        context = {"trace_id": trace_id}
        fire(request_type="grpc", name="TTFT (ms)", response_time=(first - started) * 1e3,
             response_length=tokens, exception=None, context=context)  # fmt: skip
        if tokens > 1:
            # TPOT = (E2E − TTFT) / (output tokens − 1), in µs to survive locust's rounding.
            fire(request_type="grpc", name="TPOT (µs)", response_time=(last - first) / (tokens - 1) * 1e6,
                 response_length=tokens, exception=None, context=context)  # fmt: skip
        fire(request_type="grpc", name="E2E (ms)", response_time=(last - started) * 1e3,
             response_length=tokens, exception=None, context=context)  # fmt: skip


def gate(environment: Environment, **_: Any) -> None:
    """Turn the run into a CI gate: non-zero exit when failures or p95 latency exceed the bounds."""
    options = environment.parsed_options
    if options is None:  # an Environment built by code, not by locust's command line: no bounds were given
        return
    stats = environment.stats
    reasons = []
    if stats.total.num_requests and stats.total.fail_ratio > options.max_fail_ratio:
        reasons.append(f"failure ratio {stats.total.fail_ratio:.2%} > {options.max_fail_ratio:.2%}")
    for name, bound in (("TTFT (ms)", options.max_p95_ttft_ms), ("E2E (ms)", options.max_p95_e2e_ms)):
        entry = stats.get(name, "grpc")
        if bound and entry.num_requests and entry.get_response_time_percentile(0.95) > bound:
            reasons.append(f"p95 {name} {entry.get_response_time_percentile(0.95):.0f} > {bound:.0f}")
    if reasons:
        print("phasescope gate failed: " + "; ".join(reasons))
        environment.process_exit_code = 1


events.quitting.add_listener(gate)
