"""Run the trainer: the job API (gRPC + REST) and the training loop that runs submitted jobs."""

from __future__ import annotations

import asyncio
import functools
import logging

from services.common.config import as_dict, load_config
from services.common.grpc_server import wait_for_stop_signal
from services.common.logging import configure_logging
from services.trainer.config import TrainerConfig

log = logging.getLogger("services.trainer")


async def serve(config: TrainerConfig) -> None:
    import torch  # the trainer is one of the two processes that import torch

    from services.buffer.client import BufferClient
    from services.rollout.client import RolloutClient
    from services.trainer.loop import TrainerDeps, train_sync
    from services.trainer.server import create_server

    torch.set_num_threads(config.num_threads)
    buffer = BufferClient(config.buffer_addr, timeout_s=config.client_timeout_s)
    rollout = RolloutClient(config.rollout_addr, timeout_s=config.client_timeout_s)
    deps = TrainerDeps(buffer=buffer, rollout=rollout, master_address=config.master_address,
                       num_threads=config.num_threads)
    servers = await create_server(config, functools.partial(train_sync, deps=deps))
    log.info("trainer serving: gRPC %s:%d, REST http://%s:%d (docs at /docs)", config.host, servers.grpc.port,
             config.host, servers.rest.port)
    await wait_for_stop_signal()
    log.info("stopping")
    await servers.stop(config.grace_s)
    buffer.close()
    rollout.close()


def main(argv: list[str] | None = None) -> None:
    config = load_config(TrainerConfig, "trainer", argv, description=__doc__)
    configure_logging("trainer")
    log.info("config: %s", as_dict(config))
    asyncio.run(serve(config))


if __name__ == "__main__":
    main()
