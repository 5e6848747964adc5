"""Run the trainer's rank 0: the job API (gRPC + REST) and the driver of submitted jobs (ranks > 0 run
`python -m services.trainer.ranks.worker` and join it)."""

from __future__ import annotations

import asyncio
import functools
import logging
import threading

from services.common import write_roots
from services.common.config import as_dict, load_config
from services.common.grpc_server import wait_for_stop_signal
from services.common.logging import configure_logging
from services.trainer.api.config import TrainerConfig
from services.trainer.ranks.rank_exit import exit_rank

log = logging.getLogger("services.trainer")

LOST_POLL_S = 0.5
RANK_LOST_EXIT = 3  # a rank was lost mid-job: its supervisor (Kubernetes, a test harness) starts all the ranks again


async def serve(config: TrainerConfig) -> int:
    import torch  # the trainer is one of the two processes that import torch

    from services.buffer.client import BufferClient
    from services.rollout.client import RolloutClient
    from services.trainer.api.server import create_server
    from services.trainer.distributed.parallel import init_world
    from services.trainer.driver.deps import TrainerDeps
    from services.trainer.driver.loop import train
    from services.trainer.driver.sample_board import SampleBoard
    from services.trainer.ranks.worker import Dispatcher

    torch.set_num_threads(config.num_threads)
    world = await asyncio.to_thread(init_world, rank=0, world_size=config.world_size, master_addr=config.master_addr,
                                    master_port=config.master_port, backend=config.dist_backend,
                                    timeout_s=config.dist_timeout_s, device=config.device)
    buffer = BufferClient(config.buffer_addr, timeout_s=config.client_timeout_s)
    rollout = RolloutClient(config.rollout_addr, timeout_s=config.client_timeout_s)
    board = SampleBoard()  # the driver records each rollout's samples, the dashboard shows them
    deps = TrainerDeps(buffer=buffer, rollout=rollout, master_address=config.master_address,
                       num_threads=config.num_threads, world=world, tensorboard_dir=config.tensorboard_dir,
                       board=board)
    dispatcher = Dispatcher(world, functools.partial(train, deps=deps))
    servers = await create_server(config, dispatcher, board)
    log.info("trainer serving (rank 0 of %d): gRPC %s:%d, REST http://%s:%d (docs at /docs)", world.world_size,
             config.host, servers.grpc.port, config.host, servers.rest.port)
    lost = servers.registry.ranks_lost
    await wait_for_stop_signal_or(lost)
    log.info("stopping" + (": a trainer rank was lost; exiting for all the ranks to restart" if lost.is_set() else ""))
    await servers.stop(config.grace_s, config.preempt_timeout_s)
    dispatcher.close()
    if not lost.is_set() and dispatcher.in_step:  # the workers, told to stop, close the world with rank 0
        await asyncio.to_thread(world.close)
    buffer.close()
    rollout.close()
    return RANK_LOST_EXIT if lost.is_set() else 0


async def wait_for_stop_signal_or(event: threading.Event) -> None:
    """Return on SIGTERM or SIGINT, or once `event` is set (checked every LOST_POLL_S)."""
    signalled = asyncio.create_task(wait_for_stop_signal())
    while not (signalled.done() or event.is_set()):
        await asyncio.wait([signalled], timeout=LOST_POLL_S)
    signalled.cancel()


def main(argv: list[str] | None = None) -> int:
    config = load_config(TrainerConfig, "trainer", argv, description=__doc__)
    configure_logging("trainer")
    log.info("config: %s", as_dict(config))
    write_roots.configure(config.checkpoint_roots, config.export_roots)  # checked again at each write
    if config.rank != 0:
        log.error("rank %d: ranks > 0 run `python -m services.trainer.ranks.worker`", config.rank)
        return 2
    return asyncio.run(serve(config))


if __name__ == "__main__":
    exit_rank(main())
