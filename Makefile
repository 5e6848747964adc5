# Physarum's entry points. `make demo` and `make test` do all set-up on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: setup demo test unit lint proto redis-server clean

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

demo: setup
	$(BIN)/python -m physarum.demo

test: setup
	$(BIN)/python -m pytest -q -ra

unit: setup
	$(BIN)/python -m pytest -q tests/unit

lint: setup
	$(BIN)/ruff check .

proto: setup
	$(BIN)/python proto/generate.py

clean:
	rm -rf .physarum .pytest_cache
