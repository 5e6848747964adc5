"""Shared-memory weight copies are named by owner, job and trainer process, and a copy whose process is gone (a
SIGKILLed trainer) is removed by the next trainer's broadcaster and by the supervisor's sweep; live ones and other
owners' are left alone."""

from __future__ import annotations

import os
import subprocess
import sys

from services.common import weight_copies
from services.trainer.weight_sync.shm import SharedMemoryBroadcaster


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_copies_of_gone_processes_are_removed_and_no_others(tmp_path):
    uid, gone = os.getuid(), dead_pid()
    dead = weight_copies.snapshot_dir(tmp_path, "job/a b", pid=gone)
    live = weight_copies.snapshot_dir(tmp_path, "job-b", pid=os.getpid())
    other_owner = tmp_path / f"{weight_copies.PREFIX}-{uid + 1}-job-{gone}"
    unrelated = tmp_path / "something-else"
    for path in (dead, live, other_owner, unrelated):
        path.mkdir()
        (path / "model.safetensors").write_bytes(b"w" * 16)
    assert dead.name == f"physarum-weights-{uid}-job_a_b-{gone}"
    assert weight_copies.remove_stale(tmp_path) == [dead]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in (live, other_owner, unrelated))


def test_a_restarted_trainers_broadcaster_sweeps_and_names_its_copy_by_job(tmp_path):
    left = weight_copies.snapshot_dir(tmp_path, "job-1", pid=dead_pid())
    left.mkdir()
    broadcaster = SharedMemoryBroadcaster([], root=tmp_path, job_id="job-1")
    assert not left.exists()
    assert broadcaster.root == tmp_path / f"physarum-weights-{os.getuid()}-job-1-{os.getpid()}"
    broadcaster.root.mkdir()
    broadcaster.close()
    assert not broadcaster.root.exists()
