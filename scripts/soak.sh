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

# shellcheck source=scripts/background-server.sh
source scripts/background-server.sh
start_server

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
    --stop-timeout 60 --host "$ADDRESS" --max-tokens "$MAX_TOKENS" --max-fail-ratio 0 \
    --csv "$RESULTS/locust" --html "$RESULTS/locust.html" || status=$?
end_state=$(process_state)
served=$("$BIN/python" -c "import csv; r={x['Name']: x for x in csv.DictReader(open('$RESULTS/locust_stats.csv'))}; print(r['E2E (ms)']['Request Count'], r['Aggregated']['Failure Count'])")
echo "soak $SOAK_TIME, $USERS users: requests served / failures: $served"
echo "server at start: $start_state"
echo "server at end:   $end_state"
exit "$status"
