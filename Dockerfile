# syntax=docker/dockerfile:1
# pagedserve images: one Dockerfile, an image per plane (docs/deploy.md):
#
#   control plane (no torch: the protos, common and controlplane distributions only):
#     docker build --target controlplane -t pagedserve:0.1.0-controlplane .
#   CPU  (CPU data planes, `models pull`, `serve`: every distribution):
#     docker build --build-arg TORCH_INDEX_URL=<PyTorch's CPU-only wheel index> -t pagedserve:0.1.0-cpu .
#   CUDA (GPU data planes; torch's CUDA wheels bring the CUDA libraries, the node its driver):
#     docker build --build-arg VARIANT=cuda -t pagedserve:0.1.0-cuda .
#
# All run as a non-root user (uid 10001) with the model store on the /models volume
# (`pagedserve models pull` fills it). The CPU and CUDA images' default command serves one
# control plane and one data plane; the Helm chart runs `pagedserve-controlplane` in the
# control-plane image and `pagedserve dataplane` in the CPU or CUDA one.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# ---- controlplane-builder: a virtual environment with the control plane's distributions only ------
FROM base AS controlplane-builder
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY protos ./protos
COPY common ./common
COPY controlplane ./controlplane
# Fail the build if anything pulled in the model stack.
RUN pip install ./protos ./common ./controlplane \
    && pagedserve-controlplane --help >/dev/null \
    && python -c 'import importlib.util as u; bad = [m for m in ("torch", "transformers", "triton") if u.find_spec(m)]; assert not bad, bad'

# ---- builder: a virtual environment with torch, every distribution and the extras --------------
FROM base AS builder
# cpu: no Triton; cuda: the Triton kernels (the default attention on CUDA).
ARG VARIANT=cpu
# The project pins torch==2.13.0. Empty index: the default package index (whose Linux wheels are
# CUDA builds); give PyTorch's CPU-only index for a CPU image a few GB smaller.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=""
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN if [ -n "${TORCH_INDEX_URL}" ]; then \
        pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"; \
    else \
        pip install "torch==${TORCH_VERSION}"; \
    fi
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
COPY protos ./protos
COPY common ./common
COPY clients/python ./clients/python
COPY kernels ./kernels
COPY controlplane ./controlplane
COPY dataplane ./dataplane
COPY benchmarks ./benchmarks
# Each plane is its own distribution: pip takes them from their folders, then the `pagedserve`
# meta distribution that requires them. `convert` is what `pagedserve models pull` needs (gguf,
# accelerate). The versions are pinned in the pyproject.toml files (DL3013 asks for pins on the
# command line).
# hadolint ignore=DL3013
RUN case "${VARIANT}" in \
        cpu) extras="convert" ;; \
        cuda) extras="convert,triton" ;; \
        *) echo "VARIANT must be cpu or cuda, got ${VARIANT}" >&2; exit 1 ;; \
    esac \
    && pip install ./protos ./common ./clients/python ./kernels ./controlplane ./dataplane ./benchmarks \
        ".[${extras}]" \
    && pagedserve --version
# The C++ CPU kernels are compiled on first use from their sources (kernels/src/pagedserve/kernels/cpu_ext.py): the
# package data carries them; fail the build here if a source or header is missing.
RUN python -c 'import pathlib, pagedserve.kernels as k; cpu = pathlib.Path(k.__file__).parent / "cpu"; \
    missing = [p.name for p in pathlib.Path("kernels/src/pagedserve/kernels/cpu").iterdir() if not (cpu / p.name).exists()]; \
    assert not missing, missing'

# ---- controlplane: the control plane's image (no torch, no compiler) -----------------------------
FROM base AS controlplane
RUN groupadd --gid 10001 pagedserve \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/pagedserve \
        --shell /usr/sbin/nologin pagedserve \
    && mkdir -p /models \
    && chown 10001:10001 /models
COPY --from=controlplane-builder /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    HOME=/home/pagedserve \
    PAGEDSERVE_MODEL_HOME=/models
LABEL org.opencontainers.image.title="pagedserve-controlplane" \
      org.opencontainers.image.description="LLM inference server on a paged KV cache: the control plane" \
      org.opencontainers.image.licenses="Apache-2.0"
VOLUME ["/models"]
WORKDIR /home/pagedserve
USER 10001:10001
# gRPC and HTTP
EXPOSE 50051 8000
ENTRYPOINT ["pagedserve-controlplane"]
CMD ["--host", "0.0.0.0"]

# ---- runtime: the CPU or CUDA image (data planes, `models pull`, `serve`) -------------------------
FROM base AS runtime
ARG VARIANT=cpu
# g++: torch builds the C++ CPU attention kernels at first use (without it, the slower torch
# path runs); Triton compiles its launcher stubs with the C compiler on CUDA. Debian's g++ of the
# base image's release (DL3008 asks for an apt version pin).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
RUN groupadd --gid 10001 pagedserve \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/pagedserve \
        --shell /usr/sbin/nologin pagedserve \
    && mkdir -p /models \
    && chown 10001:10001 /models
COPY --from=builder /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    HOME=/home/pagedserve \
    PAGEDSERVE_MODEL_HOME=/models \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    PAGEDSERVE_IMAGE_VARIANT=${VARIANT}
LABEL org.opencontainers.image.title="pagedserve" \
      org.opencontainers.image.description="LLM inference server on a paged KV cache (${VARIANT})" \
      org.opencontainers.image.licenses="Apache-2.0"
VOLUME ["/models"]
WORKDIR /home/pagedserve
USER 10001:10001
# control plane gRPC and HTTP, data plane gRPC and metrics
EXPOSE 50051 8000 50052 9100
ENTRYPOINT ["pagedserve"]
CMD ["serve", "--host", "0.0.0.0"]
