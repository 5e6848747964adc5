"""`python -m services.rollout`: the rollout manager (engine pool + generation loop) until SIGTERM."""

from __future__ import annotations

import asyncio
import gc
import logging
import sys

from services.common.config import as_dict, load_config
from services.common.grpc_server import wait_for_stop_signal
from services.common.logging import configure_logging
from services.rollout.config import RolloutManagerConfig
from services.rollout.server import create_server

log = logging.getLogger("services.rollout")


async def serve(config: RolloutManagerConfig) -> int:
    stop = asyncio.create_task(wait_for_stop_signal())
    server = await create_server(config)
    # What start-up built (modules, the server, the pool: some 90,000 objects) lives as long as the process: frozen,
    # the full collections that a rollout's samples set off stop walking it each time (at 64 engines those walks were
    # about a fifth of the manager's CPU per sample: bench/control_plane.py)
    gc.freeze()
    await asyncio.wait({stop, server.pool_start}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if server.pool_start.done() and server.pool_start.exception() is not None:
        log.error("engine pool failed to start: %s", server.pool_start.exception())
        code = 1
    elif not stop.done():
        await stop
    log.info("stopping")
    stop.cancel()
    await server.stop(config.grace_s)
    return code


def main(argv: list[str] | None = None) -> int:
    config = load_config(RolloutManagerConfig, "rollout", argv, description=__doc__)
    configure_logging("rollout")
    log.info("config: %s", as_dict(config))
    return asyncio.run(serve(config))


if __name__ == "__main__":
    sys.exit(main())
