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

# shellcheck source=scripts/background-server.sh
source scripts/background-server.sh
if [[ -z "${ADDRESS:-}" ]]; then
    start_server
fi

# shellcheck disable=SC2086  # LOCUST_ARGS is a list of flags on purpose
"$BIN/locust" -f loadtests/locustfile.py --headless --only-summary \
    -u "$USERS" -r "$RATE" -t "$TIME" --stop-timeout 30 --host "$ADDRESS" \
    --max-tokens "$MAX_TOKENS" --csv "$RESULTS/locust" --html "$RESULTS/locust.html" ${LOCUST_ARGS:-}
echo "reports: $RESULTS/locust_stats.csv, $RESULTS/locust.html"
