"""A trainer pod's entry point (`python -m services.trainer.ranks.launch`): one process per visible GPU, as torchrun.

Local rank r of pod p is global rank p × nproc_per_pod + r, with torchrun's RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE and GROUP_RANK; global rank 0 runs the trainer service, the others `services.trainer.ranks.worker`.
Each rank is a fresh interpreter (spawned, never forked: CUDA cannot live in a forked child). When one rank exits
with an error the others are stopped and the launcher exits with its code; SIGTERM is passed on to every rank.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from services.common.config import field, load_config
from services.common.logging import configure_logging

log = logging.getLogger("services.trainer.ranks.launch")

POLL_S = 0.2
STOP_GRACE_S = 30.0  # how long the other ranks get to exit after one failed


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    pod_index: int = field(int(os.environ.get("POD_INDEX", "0")), "this pod's index among the trainer's pods "
                                                                   "(default: $POD_INDEX)")
    num_pods: int = field(int(os.environ.get("NUM_PODS", "1")), "trainer pods (default: $NUM_PODS)")
    nproc_per_pod: int = field(int(os.environ.get("NPROC_PER_POD", "0")), "ranks in this pod; 0: one per visible "
                                                                           "CUDA device (one without CUDA)")
    rank_module: str = field("", "run `python -m MODULE` on every rank instead of the trainer (a diagnostic)")

    def __post_init__(self) -> None:
        if self.num_pods < 1 or not 0 <= self.pod_index < self.num_pods:
            raise ValueError(f"pod_index must be in [0, num_pods), got pod {self.pod_index} of {self.num_pods}")
        if self.nproc_per_pod < 0:
            raise ValueError(f"nproc_per_pod must be >= 0, got {self.nproc_per_pod}")


def visible_gpus() -> int:
    """CUDA devices this process may use, without initializing CUDA here (the ranks do)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def rank_envs(*, pod_index: int, num_pods: int, nproc_per_pod: int) -> list[dict[str, str]]:
    """torchrun's variables of each local rank of pod `pod_index`."""
    world_size = num_pods * nproc_per_pod
    return [{"RANK": str(pod_index * nproc_per_pod + local), "LOCAL_RANK": str(local), "WORLD_SIZE": str(world_size),
             "LOCAL_WORLD_SIZE": str(nproc_per_pod), "GROUP_RANK": str(pod_index)} for local in range(nproc_per_pod)]


def rank_command(rank: int, rank_module: str = "") -> list[str]:
    module = rank_module or ("services.trainer" if rank == 0 else "services.trainer.ranks.worker")
    return [sys.executable, "-m", module]


def launch(config: LaunchConfig, *, env: dict[str, str] | None = None) -> int:
    """Start the pod's ranks, wait for them; the first failing rank's exit code (0 when all succeed)."""
    nproc = config.nproc_per_pod or max(1, visible_gpus())
    base = dict(os.environ if env is None else env)
    procs: list[subprocess.Popen] = []
    for rank_env in rank_envs(pod_index=config.pod_index, num_pods=config.num_pods, nproc_per_pod=nproc):
        procs.append(subprocess.Popen(rank_command(int(rank_env["RANK"]), config.rank_module),
                                      env={**base, **rank_env}))
    log.info("pod %d of %d: started ranks %s (pids %s)", config.pod_index, config.num_pods,
             [config.pod_index * nproc + r for r in range(nproc)], [p.pid for p in procs])

    def forward(signum, _frame) -> None:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _wait(procs)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _wait(procs: list[subprocess.Popen]) -> int:
    while True:
        codes = [p.poll() for p in procs]
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            local, code = failed[0]
            log.error("local rank %d exited with %d: stopping the other ranks", local, code)
            _stop(procs)
            return code
        if all(c == 0 for c in codes):
            return 0
        time.sleep(POLL_S)


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every rank still running, then SIGKILL those that outlive STOP_GRACE_S."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    config = load_config(LaunchConfig, "trainer_launch", argv, description=__doc__)
    configure_logging("trainer-launch")
    return launch(config)


if __name__ == "__main__":
    sys.exit(main())
