"""The dashboard's JSON endpoints and its static pages, mounted on the job API's FastAPI app.

The pages (`/dashboard/`) are static files and hold no data; everything they show comes from `/v1/...`, which the
job API's middleware guards with its bearer token. What the pages read: the job registry (jobs, their events and
metrics history), the latest rollout's samples (the driver's `SampleBoard`), the job's checkpoints on disk, the
trainer's log tail, the rollout manager's pool through its client and the buffer's counters through its client.
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

from fastapi import Body, FastAPI, HTTPException
from fastapi.responses import RedirectResponse
from fastapi.staticfiles import StaticFiles

from services.buffer.client import BufferClient
from services.common.errors import InvalidArgument, NotFound, PhysarumError
from services.rollout.client import PoolStatus, RolloutClient
from services.trainer.dashboard import logtail
from services.trainer.driver.sample_board import SampleBoard

STATIC_DIR = Path(__file__).parent / "static"
MAX_LOG_LINES = 1000
MAX_REPLICAS = 64  # a scale request past this is a typo, not a plan


class Peers:
    """The rollout manager's and the buffer's clients, made on first use (the dashboard may never be opened)."""

    def __init__(self, rollout_addr: str, buffer_addr: str, timeout_s: float) -> None:
        self._addrs = {"rollout": rollout_addr, "buffer": buffer_addr}
        self._timeout_s = timeout_s
        self._clients: dict[str, Any] = {}
        self._lock = threading.Lock()

    def _get(self, name: str, cls):
        with self._lock:
            if name not in self._clients:
                self._clients[name] = cls(self._addrs[name], timeout_s=self._timeout_s, max_retries=1)
            return self._clients[name]

    @property
    def rollout(self) -> RolloutClient:
        return self._get("rollout", RolloutClient)

    @property
    def buffer(self) -> BufferClient:
        return self._get("buffer", BufferClient)

    def close(self) -> None:
        with self._lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()


def pool_to_dict(status: PoolStatus) -> dict[str, Any]:
    values = dataclasses.asdict(status)
    values["engines"] = [{**dataclasses.asdict(e), "state": e.state.name} for e in status.engines]
    return values


def checkpoints_of(save_dir: str) -> dict[str, Any]:
    """The iter_* checkpoints under a job's `save` directory, newest first, and the one in force."""
    from services.trainer.checkpoint.iterations import LATEST_FILE

    if not save_dir or not Path(save_dir).is_dir():
        return {"save": save_dir, "latest": None, "checkpoints": []}
    root = Path(save_dir)
    latest_file = root / LATEST_FILE
    latest = latest_file.read_text().strip() if latest_file.is_file() else ""
    found = []
    for path in sorted(root.glob("iter_*"), reverse=True):
        suffix = path.name.removeprefix("iter_")
        if path.is_dir() and suffix.isdigit():
            found.append({"rollout_id": int(suffix), "path": str(path), "time": path.stat().st_mtime})
    return {"save": save_dir, "latest": int(latest) if latest.isdigit() else None, "checkpoints": found}


def _unavailable(what: str, err: Exception) -> HTTPException:
    return HTTPException(status_code=503, detail=f"{what}: {err}")


def mount_dashboard(app: FastAPI, registry, board: SampleBoard, *, rollout_addr: str, buffer_addr: str,
                    timeout_s: float = 5.0) -> Peers:
    """Add the dashboard's pages and endpoints to the job API `app` (whose middleware guards /v1/*); `board` holds
    the latest rollout's samples the driver recorded."""
    peers = Peers(rollout_addr, buffer_addr, timeout_s)
    tail = logtail.install()

    def job_of(job_id: str):
        try:
            return registry.get(job_id)
        except NotFound as err:
            raise HTTPException(status_code=404, detail=str(err)) from None

    @app.get("/", include_in_schema=False)
    def root() -> RedirectResponse:
        return RedirectResponse("/dashboard/")

    @app.get("/v1/dashboard/jobs/{job_id}/samples", tags=["dashboard"])
    def job_samples(job_id: str) -> dict[str, Any]:
        """The latest rollout's samples (none yet: an empty list at rollout -1)."""
        job_of(job_id)
        return board.latest(job_id) or {"job_id": job_id, "rollout_id": -1, "num_samples": 0, "samples": []}

    @app.get("/v1/dashboard/jobs/{job_id}/samples/{position}/session", tags=["dashboard"])
    def sample_session(job_id: str, position: int, rollout_id: int) -> dict[str, Any]:
        """The agent session of the latest rollout's sample at `position` (in the samples list) as its agent saw it:
        each turn's new messages, the reply with its tool calls, its tokens and whether it is trained."""
        job_of(job_id)
        found = board.session(job_id, rollout_id, position)
        if found is None:
            raise HTTPException(status_code=404, detail=f"job {job_id}: no agent session at sample {position} of "
                                                        f"rollout {rollout_id} (the latest rollout's samples only)")
        return found

    @app.get("/v1/dashboard/jobs/{job_id}/checkpoints", tags=["dashboard"])
    def job_checkpoints(job_id: str) -> dict[str, Any]:
        return checkpoints_of(job_of(job_id).spec.driver.save)

    @app.get("/v1/dashboard/jobs/{job_id}/log", tags=["dashboard"])
    def job_log(job_id: str, lines: int = 200) -> dict[str, Any]:
        """The trainer's last `lines` log lines about this job."""
        job_of(job_id)
        if not 0 < lines <= MAX_LOG_LINES:
            raise HTTPException(status_code=400, detail=f"lines must be in 1..{MAX_LOG_LINES}, got {lines}")
        return {"job_id": job_id, "lines": tail.tail(job_id, lines)}

    @app.get("/v1/dashboard/pool", tags=["dashboard"])
    def pool() -> dict[str, Any]:
        """The engine pool as the rollout manager sees it: engines, weight versions, load, join/leave events."""
        try:
            return pool_to_dict(peers.rollout.pool_status())
        except PhysarumError as err:
            raise _unavailable(f"rollout manager {rollout_addr}", err) from None

    @app.post("/v1/dashboard/pool/scale", tags=["dashboard"])
    def scale(replicas: int = Body(..., embed=True, description="the desired number of engines")) -> dict[str, Any]:
        if not 0 <= replicas <= MAX_REPLICAS:
            raise HTTPException(status_code=400, detail=f"replicas must be in 0..{MAX_REPLICAS}, got {replicas}")
        try:
            return pool_to_dict(peers.rollout.scale(replicas))
        except InvalidArgument as err:
            raise HTTPException(status_code=400, detail=str(err)) from None
        except PhysarumError as err:
            raise _unavailable(f"rollout manager {rollout_addr}", err) from None

    @app.get("/v1/dashboard/buffer/{job_id}", tags=["dashboard"])
    def buffer(job_id: str) -> dict[str, Any]:
        """The buffer's counters for the job (its queue of prompts, leases, groups written) and the stale groups
        the trainer's last rollout reported."""
        metrics = job_of(job_id).metrics
        try:
            stats = dataclasses.asdict(peers.buffer.stats(job_id))
        except NotFound:
            stats = None  # no dataset loaded for it (yet)
        except PhysarumError as err:
            raise _unavailable(f"buffer {buffer_addr}", err) from None
        stale = {k: v for k, v in metrics.items() if k.startswith("buffer/stale_") or "staleness" in k}
        return {"job_id": job_id, "stats": stats, "stale": stale}

    app.mount("/dashboard", StaticFiles(directory=STATIC_DIR, html=True), name="dashboard")
    return peers
