#!/usr/bin/env bash
# The whole suite, as `make test` and CI run it. The fast lane first (format, lint, layering,
# types, unit tests: no engine, about a minute), so a mistake there fails before the slow
# half starts: the vLLM adapter's tests and the integration suite on the real engine.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${VENV:-.venv}/bin

# Each step says how far into the run it starts (bash's SECONDS: seconds since the script began).
step() { printf '\n==> [%ds] %s\n' "$SECONDS" "$*"; }

step "ruff check"
"$BIN/ruff" check .
step "ruff format --check"
"$BIN/ruff" format --check .
step "import-linter (layering contracts in pyproject.toml)"
"$BIN/lint-imports"
# mypy and the unit tests each keep one core busy for about a minute: they run side by side, mypy's report
# printed when both are done.
mypy_log=$(mktemp)
"$BIN/mypy" >"$mypy_log" 2>&1 &
mypy_pid=$!
# On a fresh machine the engine tests' models are prepared beside them too (the default model from its GGUF file,
# about 30 s of one core, and the tiny random-weight model): otherwise the first server waits for that, and every
# other server behind its lock. Where they are cached this takes a second.
models_log=$(mktemp)
{ "$BIN/phasescope" prepare-model && "$BIN/python" -c \
    'from phasescope.bench.tiny_model import ensure_tiny_model; print(ensure_tiny_model())'; } >"$models_log" 2>&1 &
models_pid=$!
trap 'kill "$mypy_pid" "$models_pid" 2>/dev/null || true; rm -f "$mypy_log" "$models_log"' EXIT
step "unit tests (no engine), with mypy --strict beside them"
units=0
"$BIN/pytest" tests/unit -q || units=$?
typed=0
wait "$mypy_pid" || typed=$?
step "mypy --strict"
cat "$mypy_log"
if ((units || typed)); then
    exit 1
fi
step "the models the engine tests serve (prepared beside the fast lane)"
prepared=0
wait "$models_pid" || prepared=$?
cat "$models_log"
if ((prepared)); then
    exit 1
fi
step "engine-package and integration tests (vLLM and PyTorch; real engine, real servers)"
# Two workers, each taking whole modules (a module's servers are its own), in the order collected (the longest
# first: tests/integration/conftest.py): a server's start is mostly one busy core, so two modules side by side
# use the machine's two.
"$BIN/pytest" tests/engine tests/integration -q -n "${PHASESCOPE_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder \
    --durations=25
step "all checks passed"
