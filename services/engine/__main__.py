"""`python -m services.engine --model-path DIR`: serve SGLang's HTTP API on CPU until SIGTERM."""

from __future__ import annotations

import asyncio
import logging

from services.common.config import as_dict, load_config
from services.common.grpc_server import wait_for_stop_signal
from services.common.logging import configure_logging
from services.engine.config import EngineConfig

log = logging.getLogger("services.engine")


async def serve(config: EngineConfig) -> None:
    from services.engine.server import create_server

    server = await create_server(config)
    log.info("engine serving on http://%s:%d", config.host, server.port)
    await wait_for_stop_signal()
    log.info("stopping")
    await server.stop()


def main(argv: list[str] | None = None) -> None:
    config = load_config(EngineConfig, "engine", argv, description="Physarum CPU engine (SGLang HTTP API)")
    configure_logging("engine")
    log.info("config: %s", as_dict(config))
    asyncio.run(serve(config))


if __name__ == "__main__":
    main()
