"""The Rollout gRPC service: a thin servicer over RolloutManager and EnginePool, and the server's lifecycle.

Health turns SERVING once every engine of the pool is registered with the router.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from services.buffer.client import BufferClient
from services.common.errors import Unavailable
from services.common.gen.physarum.v1 import rollout_pb2, rollout_pb2_grpc
from services.common.grpc_server import GrpcServer, ServiceBinding, handle_errors, start_grpc_server, stop_grpc_server
from services.reward.client import RewardClient
from services.rollout.client import config_from_proto, engine_to_proto, status_to_proto
from services.rollout.config import RolloutManagerConfig
from services.rollout.manager import RolloutManager
from services.rollout.pool import EnginePool
from services.rollout.router import RouterClient

log = logging.getLogger(__name__)


class RolloutServicer(rollout_pb2_grpc.RolloutServicer):
    def __init__(self, manager: RolloutManager, pool: EnginePool, pool_ready: asyncio.Event, router_url: str) -> None:
        self.manager = manager
        self.pool = pool
        self.pool_ready = pool_ready
        self.router_url = router_url

    @handle_errors
    async def StartRollout(self, request, context):
        if not self.pool_ready.is_set():
            raise Unavailable("rollout manager: the engine pool is still starting; wait for health SERVING")
        already_running = self.manager.start_rollout(config_from_proto(request.config), request.rollout_id,
                                                     request.weight_version)
        return rollout_pb2.StartRolloutResponse(already_running=already_running)

    @handle_errors
    async def GetRolloutStatus(self, request, context):
        return status_to_proto(self.manager.status(request.job_id, request.rollout_id))

    @handle_errors
    async def ListEngines(self, request, context):
        engines = await asyncio.to_thread(self.pool.engines)
        return rollout_pb2.ListEnginesResponse(engines=[engine_to_proto(e) for e in engines],
                                               router_url=self.router_url)


@dataclass
class RolloutServer:
    """The running service: gRPC server, manager, pool, and the task that starts the pool."""

    grpc: GrpcServer
    manager: RolloutManager
    pool: EnginePool
    pool_start: asyncio.Task
    clients: list

    @property
    def port(self) -> int:
        return self.grpc.port

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop serving, cancel rollouts (their leases are returned), then stop the engines this process started."""
        await stop_grpc_server(self.grpc, grace_s)
        await self.manager.close()
        self.pool.stopping.set()
        await asyncio.wait({self.pool_start})
        await asyncio.to_thread(self.pool.stop)
        for client in self.clients:
            client.close()


async def create_server(config: RolloutManagerConfig) -> RolloutServer:
    """Serve on config.host:port (NOT_SERVING) and start the engine pool in the background."""
    buffer = BufferClient(config.buffer_addr, timeout_s=30.0)
    reward = RewardClient(config.reward_addr, timeout_s=60.0)
    router = RouterClient(config.router_url, timeout_s=10.0)
    pool = EnginePool(router, model_path=config.model_path, num_engines=config.num_engines,
                      engine_urls=config.engine_urls, num_threads=config.engine_num_threads,
                      start_timeout_s=config.engine_start_timeout_s, work_dir=config.work_dir)
    manager = RolloutManager(buffer, reward, config.router_url, model_path=config.model_path,
                             request_timeout_s=config.request_timeout_s)
    pool_ready = asyncio.Event()
    servicer = RolloutServicer(manager, pool, pool_ready, config.router_url)
    grpc_server = await start_grpc_server(
        [ServiceBinding(rollout_pb2_grpc.add_RolloutServicer_to_server, servicer, "physarum.v1.Rollout")],
        config.host, config.port, serving=False)

    async def start_pool() -> None:
        await asyncio.to_thread(pool.start)
        pool_ready.set()
        grpc_server.set_serving(True)
        log.info("rollout manager serving on %s:%d: %d engines behind router %s", config.host, grpc_server.port,
                 len(pool.urls), config.router_url)

    return RolloutServer(grpc=grpc_server, manager=manager, pool=pool, pool_start=asyncio.create_task(start_pool()),
                         clients=[buffer, reward, router])
