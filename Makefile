# Physarum's entry points. `make demo` and `make test` do all set-up on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: setup demo demo-megatron test test-fast chart-test unit lint proto redis-server clean bench fuzz chaos gpu-check

# torch first, pinned to the local CPU build: a range or a newer pin would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install -q --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

redis-server:
	@command -v redis-server >/dev/null || { \
	  echo "installing redis-server from Debian"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq redis-server >/dev/null; }

setup: $(STAMP) redis-server

SEED ?= 0
demo: setup  # `make demo SEED=n`: another seed of the model's initialisation and of both jobs
	$(BIN)/python -m physarum.demo --seed $(SEED)

demo-megatron: setup  # the same demo on the Megatron backend, TP=2 over two trainer processes
	$(BIN)/python -m physarum.demo --train-backend megatron

# Every script in bench/, each a table of ratios to a baseline measured in the same run; writes bench/RESULTS.md.
bench: setup
	$(BIN)/python bench/run_all.py

test: setup chart-test
	$(BIN)/python -m pytest -q -ra --ignore=tests/chart

# The inner loop: unit and integration tests without the e2e and slow ones (tests/conftest.py marks each test
# unit, integration or e2e by its folder; slow is set by hand).
test-fast: setup
	$(BIN)/python -m pytest -q -ra -m "not e2e and not slow" tests/unit tests/integration

# The Helm chart (deploy/helm): strict lint, render of every deploy/helm/ci/*.yaml, values.schema.json rules and
# template guards, Kubernetes 1.28 and 1.37 schemas, GPU-cluster conventions; in-process Helm SDK, offline, seconds.
chart-test: setup
	$(BIN)/python -m pytest -q -ra tests/chart

# Hostile inputs (>= 1000) against a local stack with authentication on, and random kills during a 16-rollout job;
# each ends with one JSON line (tests/fuzz). `make test` runs a short form of each (tests/fuzz/test_short.py).
fuzz: setup
	$(BIN)/python -m tests.fuzz.fuzz

chaos: setup
	$(BIN)/python -m tests.fuzz.chaos

unit: setup
	$(BIN)/python -m pytest -q tests/unit

lint: setup
	$(BIN)/ruff check .

proto: setup
	$(BIN)/python proto/generate.py

clean:
	rm -rf .physarum .pytest_cache

# What only a CUDA machine confirms (bench/gpu_check.py): both backends on CUDA against CPU, bf16, the demo on the
# GPU, throughput against a plain PyTorch loop. Without CUDA it says so and exits 0. On a machine with no venv (the
# GPU machine: `source .gpu-carry/env.sh` first) it runs the system python.
gpu-check:
	$$( [ -x $(BIN)/python ] && echo $(BIN)/python || echo $(PYTHON) ) -m bench.gpu_check

# Container images, one per service (deploy/docker/<name>.Dockerfile), built from the repository root.
# VARIANT=gpu builds trainer and engine on the CUDA base with CUDA torch, tagged <tag>-gpu.
IMAGES := buffer reward rollout engine trainer router
IMAGE_PREFIX ?= physarum
IMAGE_TAG ?= 0.1.0
VARIANT ?= cpu
DOCKER ?= docker
.PHONY: images
images:
	@command -v $(DOCKER) >/dev/null 2>&1 || { echo "make images: '$(DOCKER)' not found: install Docker (the CLI and a running engine) to build images" >&2; exit 1; }
	@$(DOCKER) info >/dev/null 2>&1 || { echo "make images: '$(DOCKER) info' failed: no Docker engine is running or reachable (see DOCKER_HOST)" >&2; exit 1; }
	@set -e; for name in $(IMAGES); do \
	  case $$name in trainer|engine) args="--build-arg VARIANT=$(VARIANT)"; \
	    tag=$(IMAGE_TAG)$$( [ "$(VARIANT)" = gpu ] && echo -gpu || true );; \
	    *) args=""; tag=$(IMAGE_TAG);; esac; \
	  echo "building $(IMAGE_PREFIX)/$$name:$$tag"; \
	  $(DOCKER) build -f deploy/docker/$$name.Dockerfile $$args -t $(IMAGE_PREFIX)/$$name:$$tag .; \
	done
