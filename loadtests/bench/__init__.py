"""`phasescope bench`: seeded load sweeps with vLLM `bench serve`-style results, plots, and side-by-side comparisons.

Load shapes: fixed concurrency (closed loop: C clients, each sends its next
request when the last one ends) and Poisson arrivals (open loop: exponential
gaps at a given rate). Every point sends `--warmup` requests first (excluded),
then `--requests` measured ones from a seeded workload; prompts differ per
request (a seeded preamble) so the prefix cache does not flatter TTFT.

Definitions (the formulas are printed with the results):
  TTFT  = first streamed token − send
  TPOT  = (E2E − TTFT) ÷ (output tokens − 1), per request
  ITL   = every gap between consecutive token arrivals, pooled over requests
  E2E   = last token − send
  output_throughput = Σ output tokens ÷ duration; total_token_throughput adds prompt tokens
  front-end CPU = user + system seconds of the serving front-end process only
                  (not its engine-core processes) per 1,000 streamed tokens

`--compare` runs the same workload, in the same run, against (a) vLLM's AsyncLLM
in this process (no network: the engine's own limit), (b) vLLM's OpenAI server
and (c) phasescope, all on the same model and engine settings, and prints
phasescope ÷ in-process and phasescope ÷ OpenAI server at every point.

Modules, one job each: `workload` (requests and their records), `targets` (what
is streamed from), `loop` (load points and sweeps), `summary` (statistics and
the server's view), `launch` (starting the servers, through `loadtests.harness`),
`plots`, and `report` (a run from the command line's arguments; the flags are
defined by `server.commands.bench`).
"""

from loadtests.bench.launch import EngineSettings, start_phasescope
from loadtests.bench.report import main

__all__ = ["EngineSettings", "main", "start_phasescope"]
