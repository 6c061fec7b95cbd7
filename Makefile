# The commands a person types. `make serve` and `make test` install whatever
# is missing first (scripts/setup.sh), so both work on a fresh machine.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.phasescope-setup
DEV_STAMP := $(VENV)/.phasescope-dev
PROTO_DIR := proto
PROTO_FILES := $(wildcard $(PROTO_DIR)/phasescope/v1/*.proto)

.PHONY: setup dev serve test lint typecheck unit integration loadtest soak proto clean-venv

setup: $(STAMP)

# Re-run the setup when what it installs from changes. A full setup also satisfies `dev`.
$(STAMP): pyproject.toml scripts/setup.sh
	PYTHON=$(PYTHON) VENV=$(VENV) bash scripts/setup.sh
	touch $(STAMP) $(DEV_STAMP)

# The fast lane's tools only (no engine): lint, types and unit tests work after this.
dev: $(DEV_STAMP)

$(DEV_STAMP): pyproject.toml scripts/setup.sh
	PYTHON=$(PYTHON) VENV=$(VENV) bash scripts/setup.sh --dev
	touch $(DEV_STAMP)

serve: setup
	$(BIN)/phasescope serve $(ARGS)

test: setup
	bash scripts/check.sh

# Headless locust against a server it starts (or ADDRESS=host:port): USERS, RATE, TIME, MAX_TOKENS, LOCUST_ARGS.
loadtest: setup
	bash scripts/loadtest.sh

# Long locust run (SOAK_TIME, default 10m) with RSS and file descriptors at start and end.
soak: setup
	bash scripts/soak.sh

# The fast lane (seconds, no engine): what the pre-commit hook and the first half of `make test` run.
lint: dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

typecheck: dev
	$(BIN)/mypy

unit: dev
	$(BIN)/pytest tests/unit

integration: setup
	$(BIN)/pytest tests/engine tests/integration

# Regenerates the committed protobuf code (proto/phasescope/v1/*.proto -> phasescope/v1/);
# tests/unit/test_proto_fresh.py fails when it is stale.
proto:
	$(BIN)/python -m grpc_tools.protoc -I$(PROTO_DIR) \
		--python_out=. --grpc_python_out=. --mypy_out=. --mypy_grpc_out=. \
		--plugin=protoc-gen-mypy=$(BIN)/protoc-gen-mypy \
		--plugin=protoc-gen-mypy_grpc=$(BIN)/protoc-gen-mypy_grpc \
		$(PROTO_FILES:$(PROTO_DIR)/%=%)

clean-venv:
	rm -rf $(VENV)
