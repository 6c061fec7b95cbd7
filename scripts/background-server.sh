# Sourced by loadtest.sh and soak.sh: start a phasescope on free loopback ports in its own
# process group, wait until health says SERVING, and stop it (engine included) on exit.
# Needs BIN and RESULTS; sets ADDRESS and server_pid.
# The shell twin of phasescope/bench/harness.py (same ports, process group and stop sequence): the
# server must outlive this script's own commands (locust, the soak's RSS probes) and hand
# them its pid, which a Python supervisor in between would only hide.

server_pid=""

stop_server() {
    if [[ -n "$server_pid" ]] && kill -0 "$server_pid" 2>/dev/null; then
        kill -TERM "$server_pid"
        for _ in $(seq 1 90); do kill -0 "$server_pid" 2>/dev/null || break; sleep 1; done
        # The server runs in its own process group: this ends its engine processes too.
        kill -KILL -- "-$server_pid" 2>/dev/null || true
    fi
}

free_port() {
    "$BIN/python" -c 'from phasescope.bench.harness import free_port; print(free_port())'
}

start_server() {
    local port metrics ready=0
    port=$(free_port)
    metrics=$(free_port)
    ADDRESS="127.0.0.1:$port"
    echo "starting phasescope on $ADDRESS (log: $RESULTS/server.log)"
    setsid "$BIN/phasescope" serve --enforce-eager --port "$port" --metrics-port "$metrics" \
        --max-model-len 2048 --kv-cache-gib 2 > "$RESULTS/server.log" 2>&1 &
    server_pid=$!
    trap stop_server EXIT
    for _ in $(seq 1 300); do
        # grep reads to the end (no -q): an early exit would SIGPIPE the client and, with pipefail, fail the check.
        if "$BIN/phasescope" info --address "$ADDRESS" --timeout 2 2>/dev/null | grep "health: SERVING" >/dev/null; then
            ready=1
            break
        fi
        kill -0 "$server_pid" 2>/dev/null || { echo "the server exited; see $RESULTS/server.log" >&2; exit 1; }
        sleep 1
    done
    if [[ "$ready" != 1 ]]; then echo "the server did not become SERVING; see $RESULTS/server.log" >&2; exit 1; fi
}
