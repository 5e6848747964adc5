"""The trainers' shared-memory weight copies on a host (weight_sync_backend shm): named by owner, job and trainer
process, and removed once their process is gone, so that a SIGKILLed trainer leaves no model-sized file in memory.
Without torch: the local supervisor sweeps them too."""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

SHM_ROOT = Path("/dev/shm")
PREFIX = "physarum-weights"
# physarum-weights-<owner uid>-<job>-<pid>: whose copy, of which job, held by which trainer process
_NAME = re.compile(rf"^{PREFIX}-(\d+)-(.*)-(\d+)$")


def default_root() -> Path:
    """/dev/shm (memory), or /tmp where there is none."""
    return SHM_ROOT if SHM_ROOT.is_dir() else Path("/tmp")


def snapshot_dir(root: Path, job_id: str, pid: int | None = None) -> Path:
    """Where trainer `pid` (this one) keeps job `job_id`'s weight copy under `root`, named by owner, job and pid."""
    job = re.sub(r"[^A-Za-z0-9_.-]+", "_", job_id)[:64] or "job"
    return root / f"{PREFIX}-{os.getuid()}-{job}-{os.getpid() if pid is None else pid}"


def remove_stale(root: Path | None = None, owner: int | None = None) -> list[Path]:
    """Remove the weight copies of `owner` (this user) whose trainer process is gone (SIGKILLed, crashed): a
    restarted trainer calls it, and so does the local supervisor after a crash. Returns what it removed."""
    root = default_root() if root is None else Path(root)
    owner = os.getuid() if owner is None else owner
    removed = []
    try:
        entries = list(root.iterdir())
    except OSError:
        return removed
    for entry in entries:
        match = _NAME.match(entry.name)
        if match is None or int(match.group(1)) != owner or _alive(int(match.group(3))):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
        log.info("removed %s: a weight copy left by trainer process %s, which is gone", entry, match.group(3))
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
