# syntax=docker/dockerfile:1
# sglang-router: balances /generate over the engines (SGLang or the CPU engine); the rollout manager adds and removes
# them through its /workers API. Its flags are the router's own (`python -m sglang_router.launch_router --help`),
# not PHYSARUM_* settings. Same version as the rollout extra in pyproject.toml.
# Image physarum-router; build from the repository root: make images (or docker build -f deploy/docker/router.Dockerfile .)
ARG PYTHON_IMAGE=python:3.11.7-slim-bookworm@sha256:d11b9bd5e49ea7401753d78f4d3b56f3aec952b85b49bcae88981f0452818e0b

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="physarum-router"
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
COPY deploy/docker/constraints.txt /tmp/constraints.txt
RUN python -m venv /opt/venv && pip install pip==26.3 \
    && pip install -c /tmp/constraints.txt sglang-router==0.3.2 \
    && useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin physarum
USER 10001:10001
# 30000: /generate, /workers, /readiness; 29000: Prometheus metrics (the router binds both; defaults are 0.0.0.0)
EXPOSE 30000 29000
ENTRYPOINT ["python", "-m", "sglang_router.launch_router"]
CMD ["--host", "0.0.0.0", "--port", "30000", "--prometheus-host", "0.0.0.0", "--prometheus-port", "29000"]
