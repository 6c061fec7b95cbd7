"""`phasescope bench`: how much load a replica takes within its SLO, and what the hardware does at that point.

Load shapes: fixed concurrency (closed loop: C clients, each sends its next request when
the last one ends) and Poisson arrivals (open loop: exponential gaps at a given rate).
Every point sends `--warmup` requests first (excluded), then `--requests` measured ones,
`--repeats` times with a seed per run; the workload (prompt and output length
distributions, a shared prefix, a prompts file, prompt or chat) is seeded, and the
results hold the exact command and every parameter.

Definitions (the formulas are printed with the results, `summary.FORMULAS`):
  TTFT  = first streamed token − send
  TPOT  = (E2E − TTFT) ÷ (output tokens − 1), per request
  ITL   = every gap between consecutive token arrivals, pooled over requests
  E2E   = last token − send
  output_throughput = Σ output tokens ÷ duration; total_token_throughput adds prompt tokens
  goodput: requests that met every --slo objective (vLLM's `request_goodput` ÷ duration)
  front-end CPU = user + system seconds of the serving front-end process only
                  (not its engine-core processes) per 1,000 streamed tokens
  speculative decoding (a server with --speculative-config, from its counters over the run):
    speculative_acceptance_rate = accepted ÷ drafted tokens,
    speculative_mean_acceptance_length = 1 + accepted tokens ÷ drafts; absent without them

What a run can do: a sweep of fixed points (a rate sweep stops at the first
over-saturated point), or an SLA search for the highest rate or concurrency whose
goodput ratio meets a target. `--compare` runs the same workload against (a) vLLM's
AsyncLLM in this process, (b) vLLM's OpenAI server, (c) phasescope over phasescope.v1,
(d) vLLM's own gRPC worker over vLLM's engine protocol (`vllm.grpc.engine.VllmEngine`,
`vllm-grpc`) and (e) the same phasescope server over that protocol (`phasescope-vllm-grpc`),
interleaved point by point (`--compare-protocol phasescope` keeps (a)–(c), `engine` (d)–(e)),
and prints phasescope ÷ in-process and phasescope ÷ OpenAI server at every point. With
`--rounds N` (N ≥ 2) each target is also set beside a baseline (vLLM's gRPC worker when it
runs) round by round: the median of the rounds' ratios with a 95 % bootstrap interval, for
output tokens/s, TTFT p50, TPOT p50 and front-end CPU per 1,000 tokens. `--variant` starts more
phasescope servers beside the first (another checkout through `PYTHONPATH`, other flags), and
`--serve-args` shapes the first; `--pool` sets kept results' rounds together. The
engine-protocol targets send token ids (tokenised on the bench side, as the smg gateway
does). Running endpoints are measured by flag, nothing started for them: any VllmEngine at
`--vllm-grpc-address`, an OpenAI-compatible gateway at `--gateway-url`.

Modules, one job each: `config` (the run's typed configuration from the flags, which
`phasescope.cli.bench` defines), `workload` (requests and their records), `slo`
(objectives and goodput), `targets` (what is streamed from), `launch` (starting the
servers, through `phasescope.bench.harness`), `loop` (runs, points across targets and repeats,
sweeps and searches), `search` (the bracketing SLA search), `saturation` (over-saturation
within a run), `spread` (a point over its repeats), `summary` (one run's statistics),
`rounds` (each target beside the baseline, round by round), `hardware` (the server's view
from /metrics), `plots`, `report` (report.md and the printed tables) and `runner` (a whole
run, and what it writes).
"""

from phasescope.bench.config import ServeVariant
from phasescope.bench.launch import EngineSettings, start_phasescope
from phasescope.bench.runner import main

__all__ = ["EngineSettings", "ServeVariant", "main", "start_phasescope"]
