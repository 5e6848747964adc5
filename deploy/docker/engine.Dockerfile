# syntax=docker/dockerfile:1
# The CPU engine: a transformers model behind SGLang's HTTP API, for clusters without GPUs (engines.backend cpu).
# `python -m services.engine`, settings from flags or PHYSARUM_ENGINE_*; the model directory is mounted at run
# time. GPU engines are SGLang itself, from SGLang's own image pinned by digest in the chart (engines.sglang.image):
# it serves the same HTTP API, so this repository builds no GPU engine image.
# Image physarum-engine; build from the repository root: make images (or docker build -f deploy/docker/engine.Dockerfile .)
ARG PYTHON_IMAGE=python:3.11.7-slim-bookworm@sha256:d11b9bd5e49ea7401753d78f4d3b56f3aec952b85b49bcae88981f0452818e0b
# where the CPU torch wheel comes from: PyTorch's CPU index, or any pip index that serves it (make TORCH_INDEX_URL=)
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

FROM ${PYTHON_IMAGE}
ARG TORCH_INDEX_URL
LABEL org.opencontainers.image.title="physarum-engine"
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
# torch alone from PyTorch's CPU index; its dependencies come from PyPI below, pinned by the constraints
RUN python -m venv /opt/venv && pip install pip==26.3 setuptools==84.2.1 \
    && pip install --no-deps --index-url ${TORCH_INDEX_URL} torch==2.13.0 \
    && useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin physarum
WORKDIR /app
# Dependencies before any source: a code change rebuilds only the COPY layers below.
COPY deploy/docker/constraints.txt pyproject.toml ./
RUN pip install --no-build-isolation -c constraints.txt ".[engine]"
COPY services ./services
USER 10001:10001
ENV PHYSARUM_ENGINE_HOST=0.0.0.0
EXPOSE 30000
ENTRYPOINT ["python", "-m", "services.engine"]
