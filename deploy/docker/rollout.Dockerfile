# syntax=docker/dockerfile:1
# The rollout manager: the generation loop and the engine pool (in a cluster its engines are the pods of the
# engine Deployment). `python -m services.rollout`, settings from flags or PHYSARUM_ROLLOUT_* (README "Configuration").
# Image physarum-rollout; build from the repository root: make images (or docker build -f deploy/docker/rollout.Dockerfile .)
ARG PYTHON_IMAGE=python:3.11.7-slim-bookworm@sha256:d11b9bd5e49ea7401753d78f4d3b56f3aec952b85b49bcae88981f0452818e0b

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="physarum-rollout"
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv && pip install pip==26.3 setuptools==84.2.1 \
    && useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin physarum
WORKDIR /app
# Dependencies from pyproject.toml and the pins alone, before any source: a code change rebuilds only the COPY layers
# below. The services run from /app (`python -m` puts the working directory on sys.path).
COPY deploy/docker/constraints.txt pyproject.toml ./
# the slime extra: the rollout service's own and the reward one, since slime's plugins (custom generate functions) run
# here and import rm_hub (sympy, pylatexenc)
RUN pip install --no-build-isolation -c constraints.txt ".[slime]"
COPY services ./services
# slime's plugins import `slime` (compat/slime: Sample, http_utils, rm_hub, ...)
COPY compat/slime ./slime
# and slime's multi-turn VLM example imports qwen_vl_utils (compat/qwen_vl_utils: images, without torch)
COPY compat/qwen_vl_utils ./qwen_vl_utils
USER 10001:10001
ENV PHYSARUM_ROLLOUT_HOST=0.0.0.0
EXPOSE 50053
ENTRYPOINT ["python", "-m", "services.rollout"]
