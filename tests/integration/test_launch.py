"""The trainer pod launcher: 2 pods × 2 local ranks form one world of 4 with torchrun's variables; a failing rank
stops its pod."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from services.common.procs import free_port
from services.trainer.ranks.launch import rank_envs

REPO = Path(__file__).resolve().parents[2]


def test_rank_envs_map_pods_and_local_ranks_to_global_ranks():
    envs = rank_envs(pod_index=1, num_pods=2, nproc_per_pod=2)
    assert [(e["RANK"], e["LOCAL_RANK"], e["GROUP_RANK"]) for e in envs] == [("2", "0", "1"), ("3", "1", "1")]
    assert {(e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"]) for e in envs} == {("4", "2")}


def launcher(pod: int, env: dict[str, str], module: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "services.trainer.ranks.launch", "--pod-index", str(pod),
                             "--num-pods", "2", "--nproc-per-pod", "2", "--rank-module", module],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def test_two_pods_of_two_local_ranks_form_one_world(tmp_path):
    out = tmp_path / "ranks.json"
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "PROBE_OUT": str(out),
           "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    pods = [launcher(pod, env, "tests.integration.launch_probe") for pod in (0, 1)]
    for pod in pods:
        output, _ = pod.communicate(timeout=300)
        assert pod.returncode == 0, output.decode()[-3000:]
    ranks = json.loads(out.read_text())
    assert [(r["RANK"], r["LOCAL_RANK"], r["GROUP_RANK"], r["dist_rank"]) for r in ranks] == [
        ("0", "0", "0", 0), ("1", "1", "0", 1), ("2", "0", "1", 2), ("3", "1", "1", 3)]
    assert {(r["WORLD_SIZE"], r["LOCAL_WORLD_SIZE"], r["device"]) for r in ranks} == {("4", "2", "cpu")}


def test_a_failing_rank_stops_the_pod_with_its_exit_code(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-m", "services.trainer.ranks.launch", "--nproc-per-pod", "2",
                           "--rank-module", "tests.integration.launch_fail"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "local rank 1 exited with 3" in proc.stderr
