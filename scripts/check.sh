#!/usr/bin/env bash
# The whole suite, as `make test` and CI run it. The fast lane first (format, lint, layering,
# types, unit tests: no engine, about a minute), so a mistake there fails before the slow
# half starts: the vLLM adapter's tests and the integration suite on the real engine.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${VENV:-.venv}/bin

step() { printf '\n==> %s\n' "$*"; }

step "ruff check"
"$BIN/ruff" check .
step "ruff format --check"
"$BIN/ruff" format --check .
step "import-linter (layering contracts in pyproject.toml)"
"$BIN/lint-imports"
step "mypy --strict"
"$BIN/mypy"
step "unit tests (no engine)"
"$BIN/pytest" tests/unit -q
step "engine-package and integration tests (vLLM and PyTorch; real engine, real servers)"
# Two workers, each taking whole modules (a module's servers are its own), in the order collected (the longest
# first: tests/integration/conftest.py): a server's start is mostly one busy core, so two modules side by side
# use the machine's two.
"$BIN/pytest" tests/engine tests/integration -q -n "${PHASESCOPE_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder \
    --durations=25
