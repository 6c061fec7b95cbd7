#!/usr/bin/env bash
# Soak: locust against a phasescope it starts, for SOAK_TIME (default 10m), then a report:
# requests served, failures (the run fails unless zero), the server's RSS and open file
# descriptors at start and end. Loopback only; bounded in users and time.
#   SOAK_TIME (10m) USERS (8) MAX_TOKENS (48) RESULTS (loadtests/results/soak)
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${VENV:-.venv}/bin
SOAK_TIME=${SOAK_TIME:-10m}
USERS=${USERS:-8}
MAX_TOKENS=${MAX_TOKENS:-48}
RESULTS=${RESULTS:-loadtests/results/soak}
mkdir -p "$RESULTS"

port=$("$BIN/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
metrics=$("$BIN/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
address="127.0.0.1:$port"
setsid "$BIN/phasescope" serve --enforce-eager --port "$port" --metrics-port "$metrics" \
    --max-model-len 2048 --kv-cache-gib 2 > "$RESULTS/server.log" 2>&1 &
server_pid=$!
stop_server() {
    kill -TERM "$server_pid" 2>/dev/null || true
    for _ in $(seq 1 90); do kill -0 "$server_pid" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$server_pid" 2>/dev/null || true
}
trap stop_server EXIT
for _ in $(seq 1 300); do
    # grep reads to the end (no -q): an early exit would SIGPIPE the client and, with pipefail, fail the test.
    if "$BIN/phasescope" info --address "$address" --timeout 2 2>/dev/null | grep "health: SERVING" >/dev/null; then ready=1; break; fi
    kill -0 "$server_pid" 2>/dev/null || { echo "the server exited; see $RESULTS/server.log" >&2; exit 1; }
    sleep 1
done
if [[ "${ready:-0}" != 1 ]]; then echo "the server did not become SERVING; see $RESULTS/server.log" >&2; exit 1; fi

process_state() {
    "$BIN/python" - "$server_pid" <<'PY'
import sys, psutil
p = psutil.Process(int(sys.argv[1]))
print(f"rss_mib={p.memory_info().rss / 2**20:.1f} fds={p.num_fds()} threads={p.num_threads()}")
PY
}
start_state=$(process_state)
echo "start: $start_state"
status=0
"$BIN/locust" -f loadtests/locustfile.py --headless --only-summary -u "$USERS" -r "$USERS" -t "$SOAK_TIME" \
    --stop-timeout 60 --host "$address" --max-tokens "$MAX_TOKENS" --max-fail-ratio 0 \
    --csv "$RESULTS/locust" --html "$RESULTS/locust.html" || status=$?
end_state=$(process_state)
served=$("$BIN/python" -c "import csv; r={x['Name']: x for x in csv.DictReader(open('$RESULTS/locust_stats.csv'))}; print(r['E2E (ms)']['Request Count'], r['Aggregated']['Failure Count'])")
echo "soak $SOAK_TIME, $USERS users: requests served / failures: $served"
echo "server at start: $start_state"
echo "server at end:   $end_state"
exit "$status"
