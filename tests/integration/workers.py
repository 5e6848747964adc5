"""Run a test's worker module (`python -m tests.integration.<worker> ARGS...`) in a session of its own, as the
tests that spawn torch.distributed ranks do: its output goes to a log, a run past the timeout kills the whole
session (the worker and the ranks it forked), and a failed run fails the test with the log's tail."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_worker(module: str, *args: str, log_path: Path, timeout_s: float) -> None:
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", module, *args], cwd=REPO, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the worker's session: it and the ranks it forked
            proc.wait()
            raise
    assert returncode == 0, log_path.read_text()[-4000:]


def run_ranks(module: str, *args: str, log_dir: Path, timeout_s: float, world_size: int = 2) -> None:
    """`world_size` processes of `python -m module ARGS...` as one torch.distributed world on loopback (torchrun's
    RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), one thread each; a failed rank fails the test with its log's tail."""
    from services.common.procs import ManagedProcess, free_port, python_module

    env = {"WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}
    ranks = [ManagedProcess(f"rank{rank}", python_module(module, *args), log_dir / f"rank{rank}.log",
                            env={**env, "RANK": str(rank)}).start() for rank in range(world_size)]
    try:
        for rank in ranks:
            assert rank.popen.wait(timeout=timeout_s) == 0, rank.log_tail()
    finally:
        for rank in ranks:
            rank.stop()
