"""`python -m services.buffer`: load the config, serve the buffer until SIGTERM, stop gracefully."""

from __future__ import annotations

import asyncio
import logging
import sys

from services.buffer.config import BufferConfig
from services.buffer.server import create_server, stop_server
from services.common.config import as_dict, load_config
from services.common.errors import Unavailable
from services.common.grpc_server import wait_for_stop_signal
from services.common.logging import configure_logging

log = logging.getLogger("services.buffer")


async def serve(config: BufferConfig) -> int:
    try:
        server = await create_server(config)
    except Unavailable as err:
        log.error("%s", err)
        return 1
    await wait_for_stop_signal()
    log.info("stopping (grace %.1f s)", config.grace_s)
    await stop_server(server, config.grace_s)
    return 0


def main(argv: list[str] | None = None) -> int:
    config = load_config(BufferConfig, "buffer", argv,
                         description="Physarum buffer: prompt datasets, leases and sample groups in Redis.")
    configure_logging("buffer")
    log.info("config: %s", as_dict(config))
    return asyncio.run(serve(config))


if __name__ == "__main__":
    sys.exit(main())
