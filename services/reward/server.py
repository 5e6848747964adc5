"""The Reward service's servers: the gRPC Score servicer and the REST app, sharing one concurrency limit.

Servicers translate proto <-> dataclasses and make one call into `scorers`.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from services.common import auth
from services.common.gen.physarum.v1 import reward_pb2, reward_pb2_grpc
from services.common.grpc_server import GrpcServer, ServiceBinding, handle_errors, start_grpc_server, stop_grpc_server
from services.common.rest import RestServer
from services.common.samples import struct_to_dict
from services.reward import rest
from services.reward.client import ScoreResult
from services.reward.config import RewardConfig
from services.reward.metrics import RewardMetrics
from services.reward.one_sample import restore_ints
from services.reward.workers import WorkerPool

log = logging.getLogger(__name__)


class RewardServicer(reward_pb2_grpc.RewardServicer):
    def __init__(self, config: RewardConfig, semaphore: asyncio.Semaphore, pool: WorkerPool,
                 metrics: RewardMetrics) -> None:
        self.config = config
        self.semaphore = semaphore
        self.pool = pool
        self.metrics = metrics

    @handle_errors
    async def Score(self, request: reward_pb2.ScoreRequest, context) -> reward_pb2.ScoreResponse:  # noqa: N802
        # the samples stay protos: each goes to its worker as the bytes it came in, decoded there
        results = await self.metrics.score_samples(
            list(request.samples), rm_type=request.rm_type, custom_rm_path=request.custom_rm_path,
            reward_key=request.reward_key, timeout_s=request.timeout_s or self.config.default_timeout_s,
            args=restore_ints(struct_to_dict(request.args)), semaphore=self.semaphore, pool=self.pool)
        return scores_to_proto(results)


def scores_to_proto(results: list[ScoreResult]) -> reward_pb2.ScoreResponse:
    """The reply, each Score built in place (a Score built apart is copied into the list: twice the work)."""
    reply = reward_pb2.ScoreResponse()
    add = reply.scores.add
    for result in results:
        msg = add(reward=result.reward, ok=result.ok)
        if result.error:  # empty ones are left unset: passing them cost more than the rest of the message
            msg.error = result.error
        if result.scores:
            msg.scores.update(result.scores)
    return reply


@dataclass
class RewardServer:
    grpc: GrpcServer
    rest: RestServer
    pool: WorkerPool

    async def stop(self, grace_s: float) -> None:
        await stop_grpc_server(self.grpc, grace_s)
        await self.rest.stop()
        self.pool.close()


async def create_server(config: RewardConfig) -> RewardServer:
    """Start the gRPC server and the REST server (ports 0 pick free ones; see .grpc.port and .rest.port)."""
    semaphore = asyncio.Semaphore(config.max_concurrency)
    pool = WorkerPool(config.num_workers, config.worker_memory_bytes)
    await pool.start()
    metrics = RewardMetrics()  # one registry for both servers; REST serves it at /metrics
    servicer = RewardServicer(config, semaphore, pool, metrics)
    try:
        grpc_server = await start_grpc_server(
            [ServiceBinding(reward_pb2_grpc.add_RewardServicer_to_server, servicer, "physarum.v1.Reward")],
            config.host, config.port, token=auth.read_token("reward"), service="reward")
    except BaseException:
        pool.close()
        raise
    try:
        rest_server = RestServer(rest.create_app(config, semaphore, pool, metrics), config.host, config.rest_port)
        await rest_server.start()
    except BaseException:
        await stop_grpc_server(grpc_server, 0)
        pool.close()
        raise
    return RewardServer(grpc=grpc_server, rest=rest_server, pool=pool)
