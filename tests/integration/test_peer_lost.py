"""What rank 0 of a real two-rank gloo world sees when its peer dies (SIGKILL) or stops answering past the group's
timeout: every collective raises, and `peer_lost` says so, the classification that keeps the job to resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.procs import free_port

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("mode", ["kill", "stall"])
def test_rank_0_classifies_a_collective_broken_by_its_peer_as_a_lost_peer(mode, tmp_path):
    out, port = tmp_path / "rank0.json", str(free_port())
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    ranks = [subprocess.Popen([sys.executable, "-m", "tests.integration.peer_lost_ranks", str(rank), port, mode,
                               str(out)], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for rank in (0, 1)]
    try:
        output, _ = ranks[0].communicate(timeout=120)
        assert ranks[0].returncode == 0, output.decode()[-3000:]
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
            rank.wait(timeout=30)
    results = json.loads(out.read_text())
    assert len(results) == 2
    for result in results:  # the broadcast, then the all-reduce
        assert result["error"] and result["peer_lost"], result
    # rank 0 still leaves the world: its closing barrier fails (or times out) and close returns without raising
    assert json.loads(Path(f"{out}.closed").read_text()) == {"error": ""}
