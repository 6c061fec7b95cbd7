"""The same vLLM engine-protocol requests to vLLM's own gRPC worker and to phasescope: where they differ.

    .venv/bin/python -m loadtests.worker_parity [--output docs/data/worker-parity/parity.json]

Both workers serve the default model on the same limits (float32, eager, a 2,048-token context) and get the
catalogue below, one request at a time. Each case prints both statuses; answers that both serve are compared
by finish reason and, for greedy ones, by their token ids. docs/engine-protocol.md cites the table and says,
for every difference, why it is kept.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc

from phasescope.bench.harness import PhasescopeProcess, write_results
from phasescope.bench.launch import EngineSettings, start_vllm_grpc
from phasescope.bench.targets import load_tokenizer
from phasescope.engine.default_model import DEFAULT_MODEL_NAME, ensure_default_model

CONTEXT = 2048
VOCAB = 49152


def case(prompt: list[int] | None = None, text: str = "", request_id: str = "parity", **sampling: Any) -> Any:
    request = pb.GenerateRequest(request_id=request_id, sampling_params=pb.SamplingParams(**sampling))
    if text:
        request.text = text
    elif prompt is not None:
        request.tokenized.input_ids.extend(prompt)
    return request


def catalogue(question: list[int]) -> dict[str, Any]:
    """What gateways and clients send, and its edges: each a Generate request (unary). `question` is "What is
    the capital of France?" through the model's chat template, as the gateway sends it."""
    greedy: dict[str, Any] = {"temperature": 0.0, "max_tokens": 8}
    return {
        "greedy, 8 tokens": case(question, **greedy),
        "no max_tokens (to the end of the answer)": case(question, temperature=0.0),
        "max_tokens 0": case(question, max_tokens=0),
        "max_tokens at the context's size": case(question, temperature=0.0, max_tokens=CONTEXT, ignore_eos=True),
        "max_tokens 2**31 - 1": case(question, temperature=0.0, max_tokens=2**31 - 1),
        "min_tokens above max_tokens": case(question, max_tokens=2, min_tokens=4),
        "min_tokens with no max_tokens": case(question, temperature=0.0, min_tokens=4),
        "empty prompt": case([], **greedy),
        "one-token prompt": case([1], **greedy),
        "prompt as long as the context": case([42] * CONTEXT, **greedy),
        "prompt one short of the context": case([42] * (CONTEXT - 1), temperature=0.0, max_tokens=1),
        "prompt token outside the vocabulary": case([1, VOCAB], **greedy),
        "text input": case(text="What is the capital of France?", **greedy),
        "empty request id": case(question, request_id="", **greedy),
        "temperature unset, seeded": case(question, seed=7, max_tokens=8),
        "temperature -1": case(question, temperature=-1.0, max_tokens=2),
        "temperature 2.5": case(question, temperature=2.5, max_tokens=2),
        "temperature NaN": case(question, temperature=math.nan, max_tokens=2),
        "temperature infinite": case(question, temperature=math.inf, max_tokens=2),
        "top_p 1.5": case(question, top_p=1.5, max_tokens=2),
        "top_p -0.5": case(question, top_p=-0.5, max_tokens=2),
        "top_k 1": case(question, top_k=1, max_tokens=8),
        "top_k 1,000,000": case(question, top_k=1_000_000, seed=1, max_tokens=2),
        "min_p 1.5": case(question, min_p=1.5, max_tokens=2),
        "min_p -0.5": case(question, min_p=-0.5, max_tokens=2),
        "presence_penalty 3": case(question, presence_penalty=3.0, max_tokens=2),
        "frequency_penalty -3": case(question, frequency_penalty=-3.0, max_tokens=2),
        "repetition_penalty -1": case(question, repetition_penalty=-1.0, max_tokens=2),
        "empty stop string": case(question, stop=[""], max_tokens=2),
        "10,000 stop strings": case(question, stop=[f"s{i}" for i in range(10_000)], max_tokens=2),
        "a stop string of a megabyte": case(question, stop=["x" * 2**20], max_tokens=2),
        "stop string, included in the output": case(
            question, temperature=0.0, max_tokens=16, stop=["Paris"], include_stop_str_in_output=True
        ),
        "stop token outside the vocabulary": case(question, stop_token_ids=[VOCAB + 1], **greedy),
        "5,000 stop tokens": case(question, stop_token_ids=list(range(5000)), **greedy),
        "logit_bias outside the vocabulary": case(question, logit_bias={VOCAB + 1: 1.0}, **greedy),
        "logit_bias of 200": case(question, logit_bias={3: 200.0}, **greedy),
        "logprobs 20": case(question, logprobs=20, **greedy),
        "logprobs 21": case(question, logprobs=21, **greedy),
        "logprobs -1 (all)": case(question, logprobs=-1, **greedy),
        "prompt_logprobs 21": case(question, prompt_logprobs=21, **greedy),
        "n 0 (unset)": case(question, n=0, **greedy),
        "n 2 greedy": case(question, n=2, **greedy),
        "n 2 sampled": case(question, n=2, temperature=1.0, seed=3, max_tokens=4),
        "n 200": case(question, n=200, temperature=1.0, max_tokens=1),
        "seed -1": case(question, seed=-1, temperature=1.0, max_tokens=2),
        "seed 2**31 - 1": case(question, seed=2**31 - 1, temperature=1.0, max_tokens=2),
        "ignore_eos": case(question, ignore_eos=True, **greedy),
        "skip_special_tokens and spaces": case(
            question, skip_special_tokens=True, spaces_between_special_tokens=True, **greedy
        ),
        "truncate_prompt_tokens 4": case(question, truncate_prompt_tokens=4, **greedy),
        "truncate_prompt_tokens -1 (the model's maximum)": case(question, truncate_prompt_tokens=-1, **greedy),
        "truncate_prompt_tokens 0": case(question, truncate_prompt_tokens=0, **greedy),
        "truncate_prompt_tokens beyond the context": case(question, truncate_prompt_tokens=CONTEXT + 1, **greedy),
        "json_schema that is not JSON": case(question, json_schema='{"type": ', **greedy),
        "empty regex": case(question, regex="", **greedy),
        "choice of nothing": case(question, choice=pb.ChoiceConstraint(choices=[]), **greedy),
        "choice": case(question, choice=pb.ChoiceConstraint(choices=["Paris", "Lyon"]), **greedy),
        "data_parallel_rank 1 on one engine": pb.GenerateRequest(
            request_id="parity",
            tokenized=pb.TokenizedInput(input_ids=question),
            sampling_params=pb.SamplingParams(**greedy),
            data_parallel_rank=1,
        ),
    }


def outcome(stub: Any, request: Any) -> dict[str, Any]:
    """The status, and for an answer its finish reason and output ids."""
    try:
        responses = list(stub.Generate(request, timeout=300))
    except grpc.RpcError as exc:
        return {"status": exc.code().name, "details": (exc.details() or "")[:160]}
    completes = [r.complete for r in responses if r.HasField("complete")]
    if not completes:
        return {"status": "OK", "details": "no GenerateComplete"}
    first = min(completes, key=lambda complete: complete.index)
    return {"status": "OK", "finish_reason": first.finish_reason, "output_ids": list(first.output_ids)}


def compare(
    question: list[int], ask: Callable[[Any], dict[str, Any]], other: Callable[[Any], dict[str, Any]]
) -> list[dict[str, Any]]:
    rows = []
    for name, request in catalogue(question).items():
        vllm, phasescope = ask(request), other(request)
        same_status = vllm["status"] == phasescope["status"]
        greedy = request.sampling_params.HasField("temperature") and request.sampling_params.temperature == 0
        same_answer = (
            vllm.get("finish_reason") == phasescope.get("finish_reason")
            and (not greedy or vllm.get("output_ids") == phasescope.get("output_ids"))
            if same_status and vllm["status"] == "OK"
            else None
        )
        rows.append({"case": name, "vllm": vllm, "phasescope": phasescope, "same_status": same_status,
                     "same_answer": same_answer})  # fmt: skip
        mark = "" if same_status and same_answer is not False else "  <-- differs"
        print(f"{name:52} vLLM {vllm['status']:18} phasescope {phasescope['status']:18}{mark}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, help="write the rows as JSON (.json.gz compresses)")
    args = parser.parse_args(argv)
    model = str(ensure_default_model())
    settings = EngineSettings(model, DEFAULT_MODEL_NAME, "float32", CONTEXT, 1.0, 16)
    out = Path(tempfile.mkdtemp(prefix="worker-parity-"))
    vllm, target = start_vllm_grpc(settings, out)
    try:
        phasescope = PhasescopeProcess(
            ["--enforce-eager", "--model", model, "--dtype", "float32", "--max-model-len", str(CONTEXT),
             "--kv-cache-gib", "1", "--max-concurrent-requests", "16"],
            out / "phasescope.log",
        )  # fmt: skip
        with phasescope:
            phasescope.wait_serving()
            with grpc.insecure_channel(target.address) as a, grpc.insecure_channel(phasescope.address) as b:
                rows = compare(
                    _question(model),
                    lambda r: outcome(pb_grpc.VllmEngineStub(a), r),  # type: ignore[no-untyped-call]  # no stubs
                    lambda r: outcome(pb_grpc.VllmEngineStub(b), r),  # type: ignore[no-untyped-call]  # no stubs
                )
    finally:
        vllm.stop()
    differing = [row["case"] for row in rows if not row["same_status"] or row["same_answer"] is False]
    print(f"\n{len(rows)} cases, {len(differing)} differ; logs in {out}", file=sys.stderr)
    if args.output:
        write_results(args.output, {"settings": vars(settings), "rows": rows})
    return 0


def _question(model: str) -> list[int]:
    """The question through the chat template, then tokenised without added special tokens (the gateway's way)."""
    tokenizer = load_tokenizer(model)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    rendered = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(str(rendered), add_special_tokens=False)


if __name__ == "__main__":
    sys.exit(main())
