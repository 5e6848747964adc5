"""Markers by folder, and session fixtures: real processes started once per test session, stopped by their recorded
PIDs (the router and engine fixtures of the integration tests are in tests/integration/conftest.py)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from physarum import tasks, tinymodel
from services.common import procs
from services.common.plugins import ALLOWLIST_ENV

# The plugin modules the tests' jobs and requests name; every process the tests start inherits it.
os.environ.setdefault(ALLOWLIST_ENV, "tests,examples")

TESTS = Path(__file__).resolve().parent
KIND_BY_FOLDER = {"unit": "unit", "chart": "unit", "integration": "integration", "slime_compat": "integration",
                  "e2e": "e2e", "fuzz": "e2e"}
# Integration modules over about half a minute on 2 cores (pytest --durations), left out of make test-fast; a module
# may also set pytestmark = pytest.mark.slow itself (test_elastic_job.py).
SLOW_MODULES = {"integration/test_weight_sync.py", "integration/test_netns_weight_sync.py"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """unit, integration or e2e from the test's folder under tests/, so `-m "not e2e and not slow"` is the fast set."""
    for item in items:
        path = Path(str(item.fspath)).resolve()
        if TESTS in path.parents:
            relative = path.relative_to(TESTS)
            kind = KIND_BY_FOLDER.get(relative.parts[0])
            if kind is not None:
                item.add_marker(kind)
            if relative.as_posix() in SLOW_MODULES:
                item.add_marker("slow")


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("physarum")


@pytest.fixture(scope="session")
def redis_url(session_dir):
    """A private redis-server for the whole session."""
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed: run .ci/run or `apt-get install redis-server`")
    proc, url = procs.start_redis(session_dir / "redis")
    yield url
    proc.stop()


@pytest.fixture(scope="session")
def tiny_model_dir(session_dir) -> Path:
    """A tiny Qwen3 model and character tokenizer, built once per session."""
    return tinymodel.build_tiny_model(session_dir / "tiny-model", tasks.corpus())


@pytest.fixture(scope="session")
def addition_task(session_dir) -> tuple[Path, Path]:
    return tasks.write_addition_task(session_dir / "task", num_test=50, max_operand=9)


@pytest.fixture(scope="session")
def family_model_dir(session_dir, tiny_model_dir):
    """family -> a tiny model of that family with the demo's tokenizer (tests/model_families.py), built once."""
    from tests.model_families import build_family_model

    return lambda family: build_family_model(session_dir / "families", tiny_model_dir, family)
