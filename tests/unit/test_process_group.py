"""Ending a started process ends its whole process group: children that ignore SIGTERM (as a container runtime's or
a launcher's children may) are gone once stop_group returns; the images test's stack ends its containers (`buildah
run` and what runs under it) this way."""

from __future__ import annotations

import sys
import time

from services.common import procs

TREE = """
import os, signal, subprocess, sys, time
child = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"
kids = [subprocess.Popen([sys.executable, "-c", child]) for _ in range(2)]
print("children", *[k.pid for k in kids], flush=True)
time.sleep(300)
"""


def test_stop_group_ends_children_that_ignore_sigterm(tmp_path):
    proc = procs.ManagedProcess("tree", [sys.executable, "-c", TREE], tmp_path / "tree.log").start()
    proc.wait_ready(lambda: "children" in proc.log_tail(), timeout_s=60)
    children = [int(pid) for pid in proc.log_tail().split("children", 1)[1].split()]
    deadline = time.monotonic() + 30
    while len(procs.group_members(proc.pid)) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert set(children) < set(procs.group_members(proc.pid))
    proc.stop_group(grace_s=2.0)
    assert not proc.alive()
    assert procs.group_members(proc.pid) == []

