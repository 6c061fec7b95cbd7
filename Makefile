# The commands a person types. `make serve` and `make test` install whatever
# is missing first (scripts/setup.sh), so both work on a fresh machine.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.phasescope-setup
PROTO_DIR := proto
PROTO_FILES := $(wildcard $(PROTO_DIR)/phasescope/v1/*.proto)

.PHONY: setup serve test lint typecheck unit integration loadtest soak proto clean-venv

setup: $(STAMP)

# Re-run the setup when what it installs from changes.
$(STAMP): pyproject.toml scripts/setup.sh
	PYTHON=$(PYTHON) VENV=$(VENV) bash scripts/setup.sh
	touch $(STAMP)

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

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: setup
	$(BIN)/mypy

unit: setup
	$(BIN)/pytest tests/unit

integration: setup
	$(BIN)/pytest tests/integration

# Regenerates the committed protobuf code; tests/unit/test_proto_fresh.py fails when it is stale.
proto:
	$(BIN)/python -m grpc_tools.protoc -I$(PROTO_DIR) \
		--python_out=$(PROTO_DIR) --grpc_python_out=$(PROTO_DIR) \
		--mypy_out=$(PROTO_DIR) --mypy_grpc_out=$(PROTO_DIR) \
		--plugin=protoc-gen-mypy=$(BIN)/protoc-gen-mypy \
		--plugin=protoc-gen-mypy_grpc=$(BIN)/protoc-gen-mypy_grpc \
		$(PROTO_FILES:$(PROTO_DIR)/%=%)

clean-venv:
	rm -rf $(VENV)
