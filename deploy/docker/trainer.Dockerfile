# syntax=docker/dockerfile:1
# The trainer: job API (gRPC + REST) and the train loop. `python -m services.trainer`,
# settings from flags or PHYSARUM_TRAINER_* (README "Configuration").
# VARIANT=cpu (default): python slim + the CPU build of torch 2.13.0; VARIANT=gpu: CUDA runtime + its CUDA build.
# Build from the repository root: docker build -f deploy/docker/trainer.Dockerfile -t physarum/trainer .  (or make images)
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
RUN pip install --no-build-isolation -c constraints.txt ".[trainer]"
RUN useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin physarum
USER 10001:10001
ENV PHYSARUM_TRAINER_HOST=0.0.0.0
# 50054 gRPC Jobs, 8080 REST job API, 29500 the trainer ranks' store on rank 0 (master_port)
EXPOSE 50054 8080 29500
ENTRYPOINT ["python", "-m", "services.trainer"]
