#!/usr/bin/env bash
# Headless locust run against phasescope, bounded in users, spawn rate and time.
# Starts its own server on loopback (and stops it, engine included) unless ADDRESS is given.
#
#   USERS (4) RATE (4) TIME (60s) MAX_TOKENS (64) ADDRESS (host:port) RESULTS (loadtests/results)
#   LOCUST_ARGS: more locust/workload flags, e.g. "--ignore-eos --chat --max-p95-ttft-ms 2000"
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${VENV:-.venv}/bin
USERS=${USERS:-4}
RATE=${RATE:-4}
TIME=${TIME:-60s}
MAX_TOKENS=${MAX_TOKENS:-64}
RESULTS=${RESULTS:-loadtests/results}
mkdir -p "$RESULTS"

server_pid=""
stop_server() {
    if [[ -n "$server_pid" ]] && kill -0 "$server_pid" 2>/dev/null; then
        kill -TERM "$server_pid"
        for _ in $(seq 1 90); do kill -0 "$server_pid" 2>/dev/null || break; sleep 1; done
        # The server runs in its own process group: this ends its engine processes too.
        kill -KILL -- "-$server_pid" 2>/dev/null || true
    fi
}
trap stop_server EXIT

if [[ -z "${ADDRESS:-}" ]]; then
    port=$("$BIN/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
    metrics=$("$BIN/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
    ADDRESS="127.0.0.1:$port"
    echo "starting phasescope on $ADDRESS (log: $RESULTS/server.log)"
    setsid "$BIN/phasescope" serve --enforce-eager --port "$port" --metrics-port "$metrics" \
        --max-model-len 2048 --kv-cache-gib 2 > "$RESULTS/server.log" 2>&1 &
    server_pid=$!
    for _ in $(seq 1 300); do
        # grep reads to the end (no -q): an early exit would SIGPIPE the client and, with pipefail, fail the test.
        if "$BIN/phasescope" info --address "$ADDRESS" --timeout 2 2>/dev/null | grep "health: SERVING" >/dev/null; then ready=1; break; fi
        kill -0 "$server_pid" 2>/dev/null || { echo "the server exited; see $RESULTS/server.log" >&2; exit 1; }
        sleep 1
    done
    if [[ "${ready:-0}" != 1 ]]; then echo "the server did not become SERVING; see $RESULTS/server.log" >&2; exit 1; fi
fi

# shellcheck disable=SC2086  # LOCUST_ARGS is a list of flags on purpose
"$BIN/locust" -f loadtests/locustfile.py --headless --only-summary \
    -u "$USERS" -r "$RATE" -t "$TIME" --stop-timeout 30 --host "$ADDRESS" \
    --max-tokens "$MAX_TOKENS" --csv "$RESULTS/locust" --html "$RESULTS/locust.html" ${LOCUST_ARGS:-}
echo "reports: $RESULTS/locust_stats.csv, $RESULTS/locust.html"
