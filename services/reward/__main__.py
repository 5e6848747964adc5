"""Run the Reward service: `python -m services.reward --host 127.0.0.1 --port P --rest-port Q`, until SIGTERM."""

from __future__ import annotations

import asyncio
import logging

from services.common.config import as_dict, load_config
from services.common.grpc_server import wait_for_stop_signal
from services.common.logging import configure_logging
from services.reward.config import RewardConfig
from services.reward.server import create_server

log = logging.getLogger("services.reward")


async def serve(config: RewardConfig) -> None:
    server = await create_server(config)
    log.info("reward serving: gRPC %s:%d, REST http://%s:%d (docs at /docs)", config.host, server.grpc.port,
             config.host, server.rest.port)
    await wait_for_stop_signal()
    log.info("stopping (grace %.1f s)", config.grace_s)
    await server.stop(config.grace_s)


def main(argv: list[str] | None = None) -> None:
    config = load_config(RewardConfig, "reward", argv, description="Physarum Reward service: score samples.")
    configure_logging("reward")
    log.info("config: %s", as_dict(config))
    asyncio.run(serve(config))


if __name__ == "__main__":
    main()
