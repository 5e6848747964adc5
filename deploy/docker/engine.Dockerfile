# syntax=docker/dockerfile:1
# The CPU engine: a transformers model behind SGLang's HTTP API. `python -m services.engine`,
# settings from flags or PHYSARUM_ENGINE_* (README "Configuration"); the model directory is mounted at run time.
# VARIANT=cpu (default): python slim + the CPU build of torch 2.13.0; VARIANT=gpu: the CUDA runtime base + the CUDA
# build (the engine itself still computes on CPU). On GPU nodes the engine is SGLang itself, from SGLang's own image
# (SGLang's own Docker images), which this repository does not build: point the engine Deployment at e.g.
# lmsysorg/sglang:v0.5.23-cu130 with `python3 -m sglang.launch_server`; manager and trainer speak one HTTP API to both.
# Build from the repository root: docker build -f deploy/docker/engine.Dockerfile -t physarum/engine .  (or make images)
ARG VARIANT=cpu
ARG PYTHON_IMAGE=python:3.11.7-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-runtime-ubuntu24.04

FROM ${PYTHON_IMAGE} AS base-cpu
ENV TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN python -m venv /opt/venv

FROM ${CUDA_IMAGE} AS base-gpu
ENV TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130 DEBIAN_FRONTEND=noninteractive
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/* && python3 -m venv /opt/venv

FROM base-${VARIANT}
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
# torch alone from PyTorch's index (the CPU or CUDA build of the same pin); its dependencies come from PyPI below
RUN pip install pip==26.3 setuptools==84.2.1 \
    && pip install --no-deps --index-url "$TORCH_INDEX_URL" torch==2.13.0
WORKDIR /app
COPY deploy/docker/constraints.txt pyproject.toml ./
COPY services ./services
RUN pip install --no-build-isolation -c constraints.txt ".[engine]"
RUN useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin physarum
USER 10001:10001
ENV PHYSARUM_ENGINE_HOST=0.0.0.0
EXPOSE 30000
ENTRYPOINT ["python", "-m", "services.engine"]
