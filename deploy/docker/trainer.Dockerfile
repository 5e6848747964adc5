# syntax=docker/dockerfile:1
# The trainer: job API (gRPC + REST) and the train loop. `python -m services.trainer`,
# settings from flags or PHYSARUM_TRAINER_* (README "Configuration").
# VARIANT=cpu (default): the CPU build of torch 2.13.0; VARIANT=gpu (tag <version>-gpu): its CUDA 13.0 build with the
# CUDA runtime, cuDNN and NCCL as the nvidia-* wheels torch pins exactly; the node's driver comes from the NVIDIA
# container toolkit. Both on Python 3.11, the Python constraints.txt was made on.
# Image physarum-trainer; build from the repository root: make images [VARIANT=gpu]
ARG VARIANT=cpu
ARG PYTHON_IMAGE=python:3.11.7-slim-bookworm@sha256:d11b9bd5e49ea7401753d78f4d3b56f3aec952b85b49bcae88981f0452818e0b
# where the CPU torch wheel comes from: PyTorch's CPU index, or any pip index that serves it (make TORCH_INDEX_URL=)
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

FROM ${PYTHON_IMAGE} AS base
LABEL org.opencontainers.image.title="physarum-trainer"
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv && pip install pip==26.3 setuptools==84.2.1 \
    && useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin physarum
WORKDIR /app
COPY deploy/docker/constraints.txt pyproject.toml ./

# torch alone from PyTorch's CPU index; its dependencies come from PyPI with the project's, pinned by the constraints
FROM base AS torch-cpu
ARG TORCH_INDEX_URL
RUN pip install --no-deps --index-url ${TORCH_INDEX_URL} torch==2.13.0

# the CUDA build with its dependencies (the nvidia-* wheels); the rest pinned by the constraints
FROM base AS torch-gpu
RUN pip install -c constraints.txt --index-url https://download.pytorch.org/whl/cu130 \
    --extra-index-url https://pypi.org/simple torch==2.13.0

FROM torch-${VARIANT}
WORKDIR /app
# Dependencies before any source: a code change rebuilds only the COPY layers below (the services run from /app).
RUN pip install --no-cache-dir --no-build-isolation -c constraints.txt ".[trainer]"
COPY services ./services
# slime's plugins import `slime` (compat/slime: Sample, http_utils, rm_hub, ...)
COPY compat/slime ./slime
USER 10001:10001
ENV PHYSARUM_TRAINER_HOST=0.0.0.0
# 50054 gRPC Jobs, 8080 REST job API, 29500 the trainer ranks' store on rank 0 (master_port)
EXPOSE 50054 8080 29500
ENTRYPOINT ["python", "-m", "services.trainer"]
