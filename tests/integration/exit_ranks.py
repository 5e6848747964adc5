"""Two-rank gloo worlds that end as the trainer's ranks do, for test_rank_exit: `python -m tests.integration.exit_ranks
ENDING RUNS OUT_JSON` runs RUNS worlds one after another and writes each run's two exit codes (-N: killed by signal
N; SIGABRT is -6). This process imports torch once and forks each run's ranks, which then end on their own.

A rank's last collective runs on a second group (as megatron's and FSDP2's run on groups of their own), which it
holds past World.close as FSDP2's mesh holds its group; the gloo thread that frees that collective's tensor asks for
the GIL LAG_S later, as a thread a loaded machine's scheduler kept waiting does (by chance, as CI saw), here every
time. ENDING is how the ranks then end: `exit_rank` (services.trainer.ranks.rank_exit), or `interpreter`: World.close,
then the interpreter's own exit, the ending that aborted. Either way the rank leaves garbage whose __del__ is slow,
so that an exit that finalizes the interpreter takes as long as a real trainer's, with models and megatron's modules
to tear down.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import threading
import time
import traceback
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

from services.common.procs import free_port
from services.trainer.distributed.parallel import dp_mean, init_world
from services.trainer.ranks.rank_exit import exit_rank

ENDINGS = ("exit_rank", "interpreter")
LAG_S = 2.0  # how long after its collective the freeing gloo thread asks for the GIL
FINALIZING_S = 6.0  # how long the interpreter ending's finalization lasts at least
RUN_TIMEOUT_S = 60.0
_held: list = []  # what outlives World.close: the second group, the weakrefs


def _lagging_free(_ref: weakref.ref) -> None:
    """Runs on the thread that frees the watched tensor: a gloo thread gives up the GIL for LAG_S, then asks again."""
    if threading.get_ident() != threading.main_thread().ident:
        time.sleep(LAG_S)


def watched_tensor(size: int) -> torch.Tensor:
    tensor = torch.ones(size)
    _held.append(weakref.ref(tensor, _lagging_free))
    return tensor


class _SlowFinalizer:
    """Garbage whose __del__ the interpreter's finalization runs (its last collection): it sleeps FINALIZING_S."""

    def __init__(self) -> None:
        self.cycle = self  # only the collector frees it

    def __del__(self) -> None:
        time.sleep(FINALIZING_S)


def rank_main(rank: int, port: int, ending: str) -> None:
    torch.set_num_threads(1)
    world = init_world(rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port, device="cpu",
                       timeout_s=RUN_TIMEOUT_S)
    group = dist.new_group([0, 1])
    _held.append(group)
    for step in range(3):  # what a job's last step does: the ranks' mean metrics, rank 0's broadcast, a gather
        dp_mean(float(step), world)
        world.broadcast({"step": step})
        world.gather(rank)
    # async, and no Python reference kept: the gloo thread that runs it frees its tensor, LAG_S late
    dist.all_reduce(watched_tensor(1024), group=group, async_op=True)
    gc.disable()  # the slow garbage waits for the finalization's own collection, if the rank's exit has one
    _SlowFinalizer()
    if ending == "exit_rank":
        exit_rank(0, world)
    world.close()
    sys.exit(0)


def run_world(ending: str) -> list[int]:
    """One world of two forked ranks; their exit codes (a run past RUN_TIMEOUT_S is killed: -9)."""
    port = free_port()
    pids = []
    for rank in (0, 1):
        pid = os.fork()
        if pid == 0:
            try:
                rank_main(rank, port, ending)  # never returns: the rank exits as `ending` says
            except SystemExit:
                raise  # the interpreter's own exit
            except BaseException:
                traceback.print_exc()
                os._exit(1)
        pids.append(pid)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    codes: dict[int, int] = {}
    while len(codes) < len(pids):
        for pid in pids:
            if pid not in codes and (done := os.waitpid(pid, os.WNOHANG))[0]:
                codes[pid] = os.waitstatus_to_exitcode(done[1])
        if time.monotonic() > deadline:
            for pid in set(pids) - set(codes):
                os.kill(pid, signal.SIGKILL)
                codes[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        time.sleep(0.05)
    return [codes[pid] for pid in pids]


def main(ending: str, runs: str, out: str) -> None:
    if ending not in ENDINGS:
        raise SystemExit(f"ENDING must be one of {ENDINGS}, got {ending!r}")
    torch.set_num_threads(1)  # no OpenMP pool before the forks
    Path(out).write_text(json.dumps([run_world(ending) for _ in range(int(runs))]))


if __name__ == "__main__":
    main(*sys.argv[1:])
