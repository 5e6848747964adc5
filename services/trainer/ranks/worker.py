"""The trainer's ranks > 0 (`python -m services.trainer.ranks.worker`) and rank 0's side of handing them jobs.

A worker joins the world, then loops: take rank 0's next job spec from the world's store, run the same driver on
its share (read from the buffer), report it done, wait again. It serves nothing and talks to no service but the
buffer; it exits when rank 0 says STOP or is gone.
"""

from __future__ import annotations

import logging
import os
import threading

from services.common import write_roots
from services.common.config import as_dict, load_config
from services.common.errors import FailedPrecondition
from services.common.logging import configure_logging
from services.trainer.api.config import TrainerConfig
from services.trainer.api.jobs import JobContext, Runner, failure_reason
from services.trainer.api.spec import JobSpec
from services.trainer.distributed.parallel import STOP, RankAborted, World, init_world, peer_lost
from services.trainer.driver.job import JobCancelled, RanksLost
from services.trainer.ranks.rank_exit import exit_rank

log = logging.getLogger("services.trainer.ranks.worker")

DONE_TIMEOUT_S = 60.0  # how long rank 0 waits, after a job, for the workers to finish it too


class Dispatcher:
    """Rank 0's job runner: hands each job to the workers, runs it here, then waits for every worker to finish it.

    A worker that does not finish (left waiting in a collective by a failure on rank 0 alone) means the ranks are
    out of step: later jobs fail at once, naming the cause, until the trainer's ranks are restarted. A collective
    that broke because a rank died or timed out (`peer_lost`) raises RanksLost instead of the job's failure: the
    registry keeps the job to resume and the trainer exits, to start again with all its ranks.
    """

    def __init__(self, world: World, runner: Runner) -> None:
        self.world = world
        self.runner = runner
        self.broken = ""
        self._seq = 0
        self._running = 0  # jobs handed to the workers and not yet finished by every rank
        self._lock = threading.Lock()

    @property
    def in_step(self) -> bool:
        """Every rank is between jobs, in step: they may leave the world together (World.close)."""
        return not self.broken and self._running == 0

    def __call__(self, spec: JobSpec, ctx: JobContext) -> None:
        if self.broken:
            raise FailedPrecondition(self.broken)
        if not self.world.distributed:
            self.runner(spec, ctx)
            return
        with self._lock:
            seq, self._seq = self._seq, self._seq + 1
            self._running += 1
            self.world.send_job(seq, spec.model_dump_json().encode())
        lost = False
        try:
            self.runner(spec, ctx)
        except BaseException as err:
            lost = peer_lost(err)
            if not lost:
                raise
            # a rank died or stopped answering: waiting for it to finish the job would wait for nothing
            self.broken = (f"a collective between the trainer's ranks broke during job {spec.job_id} "
                           f"({failure_reason(err)}): restart the trainer's ranks")
            log.error("%s", self.broken)
            raise RanksLost(self.broken) from err
        finally:
            missing = [] if lost else self.world.wait_done(seq, DONE_TIMEOUT_S)
            if missing:
                self.broken = (f"trainer ranks {missing} did not finish job {spec.job_id} (it failed on rank 0 while "
                               "they waited for it): the ranks are out of step; restart the trainer's ranks")
                log.error("%s", self.broken)
            with self._lock:
                self._running -= 1

    def close(self) -> None:
        """Tell the workers to exit after their current job."""
        with self._lock:
            if self.world.distributed:
                self.world.send_job(self._seq, STOP)


def run_worker(config: TrainerConfig) -> int:
    import torch

    from services.buffer.client import BufferClient
    from services.trainer.driver.deps import TrainerDeps
    from services.trainer.driver.loop import train

    torch.set_num_threads(config.num_threads)
    world = init_world(rank=config.rank, world_size=config.world_size, master_addr=config.master_addr,
                       master_port=config.master_port, backend=config.dist_backend, timeout_s=config.dist_timeout_s,
                       device=config.device)
    buffer = BufferClient(config.buffer_addr, timeout_s=config.client_timeout_s)  # each rank reads its own share
    deps = TrainerDeps(buffer=buffer, master_address=config.master_address, num_threads=config.num_threads,
                       world=world)
    seq = 0
    while True:
        try:
            payload = world.wait_job(seq)
        except torch.distributed.DistError as err:
            log.error("rank %d: rank 0 is gone (%s); exiting", world.rank, err)
            return 1
        if payload == STOP:
            log.info("rank %d: stop", world.rank)
            world.close()  # with rank 0, which closes the world once it has sent STOP
            return 0
        try:
            train(JobSpec.model_validate_json(payload), None, deps)
        except (RankAborted, JobCancelled) as err:
            log.info("rank %d: job %d: %s", world.rank, seq, err)
        except (KeyboardInterrupt, SystemExit):  # the process's own exit
            raise
        except BaseException:  # noqa: BLE001 - e.g. torch's CheckpointException; the job fails on rank 0 too
            log.exception("rank %d: job %d failed", world.rank, seq)
        try:
            world.job_done(seq)
        except torch.distributed.DistError as err:
            log.error("rank %d: rank 0 is gone (%s); exiting", world.rank, err)
            return 1
        seq += 1


def main(argv: list[str] | None = None) -> int:
    config = load_config(TrainerConfig, "trainer", argv, description=__doc__)
    configure_logging(f"trainer-{config.rank}", level=os.environ.get("PHYSARUM_LOG_LEVEL", "WARNING"))
    log.info("config: %s", as_dict(config))
    write_roots.configure(config.checkpoint_roots, config.export_roots)  # checked again at each write
    if config.rank == 0:
        log.error("rank 0 is the trainer service: run `python -m services.trainer`")
        return 2
    return run_worker(config)


if __name__ == "__main__":
    exit_rank(main())
