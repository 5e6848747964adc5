"""Session fixtures: real processes started once per test session, stopped by their recorded PIDs."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from physarum import procs, tasks, tinymodel
from services.common.plugins import ALLOWLIST_ENV

# The plugin modules the tests' jobs and requests name; every process the tests start inherits it.
os.environ.setdefault(ALLOWLIST_ENV, "tests,examples")


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
