"""Processes the integration modules share, started once per session: one sglang-router and one CPU engine.

A module that needs a router of its own policy, or engines with their own flags, still starts its own.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from services.common import procs
from services.common.errors import NotFound
from services.rollout.local import start_router
from services.rollout.pool.router import RouterClient
from testkit.engines import start_engines, stop_engines


@pytest.fixture(scope="session")
def session_router(session_dir) -> Iterator[RouterClient]:
    """The session's sglang-router (round_robin); modules take it through `shared_router`."""
    port = procs.free_port()
    proc = start_router(port, procs.free_port(), session_dir / "router.log")
    client = RouterClient(f"http://{procs.HOST}:{port}", timeout_s=10.0)
    yield client
    client.close()
    proc.stop()


def remove_workers(router: RouterClient) -> None:
    for url in router.worker_urls():
        try:
            router.remove_worker(url)
        except NotFound:
            pass  # a manager's own removal got there first


@pytest.fixture(scope="module")
def shared_router(session_router) -> Iterator[RouterClient]:
    """The session's router, with no worker when a module gets it and none after the module: each module registers
    its own engines (directly, or through the manager it starts)."""
    remove_workers(session_router)
    yield session_router
    remove_workers(session_router)


@pytest.fixture(scope="session")
def cpu_engine_url(tiny_model_dir, session_dir) -> Iterator[str]:
    """One CPU engine serving the tiny model, for tests that read from it; a test that changes its weights sets them
    back (test_engine.py) and one that needs its own flags starts its own."""
    engines = start_engines(tiny_model_dir, session_dir / "shared-engine", 1)
    yield engines[0][1]
    stop_engines(engines)
