#!/usr/bin/env bash
# The whole suite, as `make test` and CI run it: format, lint, types, unit, integration.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${VENV:-.venv}/bin

step() { printf '\n==> %s\n' "$*"; }

step "ruff check"
"$BIN/ruff" check .
step "ruff format --check"
"$BIN/ruff" format --check .
step "mypy --strict (server/, telemetry/)"
"$BIN/mypy"
step "unit tests"
"$BIN/pytest" tests/unit -q
step "integration tests (real vLLM engine, real servers)"
"$BIN/pytest" tests/integration -q
