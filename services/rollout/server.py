"""The Rollout gRPC service: a thin servicer over RolloutManager and EnginePool, the REST API beside it, and the
server's lifecycle. Health turns SERVING once the engines wanted at start serve behind the router.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

from services.buffer.client import BufferClient
from services.common import auth
from services.common.errors import Unavailable
from services.common.gen.physarum.v1 import rollout_pb2, rollout_pb2_grpc
from services.common.grpc_server import GrpcServer, ServiceBinding, handle_errors, start_grpc_server, stop_grpc_server
from services.common.rest import RestServer
from services.common.settings.rollout import RolloutConfig
from services.reward.client import RewardClient
from services.rollout import rest
from services.rollout.client import (
    config_from_proto,
    engine_to_proto,
    pool_status_to_proto,
    status_to_proto,
)
from services.rollout.config import RolloutManagerConfig
from services.rollout.gateway.app import create_app as create_gateway_app
from services.rollout.gateway.sessions import SessionRegistry
from services.rollout.generation.agents import AgentGateway
from services.rollout.generation.manager import RolloutManager
from services.rollout.pool.config import PoolConfig
from services.rollout.pool.engine_options import apply_job_options, job_engine_options
from services.rollout.pool.launchers import (
    EngineLauncher,
    KubernetesLauncher,
    LocalLauncher,
    cpu_engine_argv,
    cpu_engine_options_argv,
)
from services.rollout.pool.pool import EnginePool
from services.rollout.pool.router import RouterClient
from services.rollout.pool.sglang_launcher import parse_sglang_options, sglang_server_args, sglang_server_argv

log = logging.getLogger(__name__)


class RolloutServicer(rollout_pb2_grpc.RolloutServicer):
    def __init__(self, manager: RolloutManager, pool: EnginePool, pool_ready: asyncio.Event, router_url: str) -> None:
        self.manager = manager
        self.pool = pool
        self.pool_ready = pool_ready
        self.router_url = router_url

    async def _engines_for(self, config: RolloutConfig) -> None:
        """The pool ready, its engines running with the job's engine options (slime's --sglang-* flags)."""
        if not self.pool_ready.is_set():
            raise Unavailable("rollout manager: the engine pool is still starting; wait for health SERVING")
        timeout_s = self.pool.config.start_timeout_s + self.pool.config.disk_load_timeout_s
        for note in await apply_job_options(self.pool, config.job_id, job_engine_options(config.args), timeout_s):
            log.warning("job %s: %s", config.job_id, note)

    @handle_errors
    async def StartRollout(self, request, context):
        config = config_from_proto(request.config)
        await self._engines_for(config)
        already_running = self.manager.start_rollout(config, request.rollout_id, request.weight_version)
        return rollout_pb2.StartRolloutResponse(already_running=already_running)

    @handle_errors
    async def StopRollout(self, request, context):
        return status_to_proto(await self.manager.stop_rollout(request.job_id, request.rollout_id))

    @handle_errors
    async def GetRolloutStatus(self, request, context):
        return status_to_proto(self.manager.status(request.job_id, request.rollout_id))

    @handle_errors
    async def RunEval(self, request, context):
        config = config_from_proto(request.config)
        await self._engines_for(config)
        metrics = await self.manager.run_eval(config, request.rollout_id, request.weight_version)
        return rollout_pb2.RunEvalResponse(metrics=metrics)

    @handle_errors
    async def ListEngines(self, request, context):
        engines = await self.pool.engine_infos()
        return rollout_pb2.ListEnginesResponse(engines=[engine_to_proto(e) for e in engines],
                                               router_url=self.router_url)

    @handle_errors
    async def Scale(self, request, context):
        return pool_status_to_proto(self.pool.scale(request.replicas))

    @handle_errors
    async def GetPoolStatus(self, request, context):
        return pool_status_to_proto(self.pool.status())

    @handle_errors
    async def BeginWeightSync(self, request, context):
        plan = await self.pool.begin_weight_sync(request.weight_version, lora_name=request.lora_name)
        return rollout_pb2.BeginWeightSyncResponse(engine_urls=plan.engine_urls, snapshot_dir=plan.snapshot_dir)

    @handle_errors
    async def EndWeightSync(self, request, context):
        self.pool.end_weight_sync(request.weight_version, success=request.success,
                                  engine_urls=list(request.engine_urls), failed_urls=list(request.failed_urls),
                                  snapshot_path=request.snapshot_path, seconds=request.seconds,
                                  num_bytes=request.bytes, error=request.error, lora_name=request.lora_name)
        return rollout_pb2.EndWeightSyncResponse()


@dataclass
class RolloutServer:
    """The running service: gRPC and REST servers, manager, pool, and the task that starts the pool."""

    grpc: GrpcServer
    rest: RestServer
    gateway: RestServer
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
        await self.rest.stop()
        await self.manager.close()  # before the gateway: an agent's last turn may still be answered
        await self.gateway.stop()
        self.pool_start.cancel()
        await asyncio.wait({self.pool_start})
        await self.pool.close()
        for client in self.clients:
            client.close()


async def create_server(config: RolloutManagerConfig) -> RolloutServer:
    """Serve on config.host:port (NOT_SERVING) and start the engine pool in the background."""
    buffer = BufferClient(config.buffer_addr, timeout_s=30.0)
    reward = RewardClient(config.reward_addr, timeout_s=60.0)
    router = RouterClient(config.router_url, timeout_s=10.0)
    work_dir = Path(config.work_dir or tempfile.mkdtemp(prefix="physarum-rollout-"))
    pool = EnginePool(build_launcher(config, work_dir), router, PoolConfig(
        replicas=config.num_engines, join_mode=config.engine_join_mode,
        snapshot_dir=config.weight_snapshot_dir or str(work_dir / "snapshots"),
        health_check_interval_s=config.health_check_interval_s, health_check_timeout_s=config.health_check_timeout_s,
        health_check_first_wait_s=config.health_check_first_wait_s, start_timeout_s=config.engine_start_timeout_s,
        drain_timeout_s=config.drain_timeout_s, own_router=config.own_router), external_urls=config.engine_urls)
    registry = SessionRegistry(workers=config.gateway_workers)
    gateway_server = RestServer(create_gateway_app(registry), config.host, config.gateway_port)
    await gateway_server.start()
    local_host = "127.0.0.1" if config.host in ("0.0.0.0", "::", "") else config.host  # agents in this process
    gateway_url = config.gateway_url or f"http://{local_host}:{gateway_server.port}/v1"
    log.info("agent gateway on %s", gateway_url)
    manager = RolloutManager(buffer, reward, config.router_url, model_path=config.model_path,
                             router_policy=config.router_policy, request_timeout_s=config.request_timeout_s,
                             version_now=lambda: pool.settled_version, adapter_version_now=pool.adapter_version,
                             gateway=AgentGateway(registry, gateway_url.rstrip("/")))
    pool_ready = asyncio.Event()
    servicer = RolloutServicer(manager, pool, pool_ready, config.router_url)
    grpc_server = await start_grpc_server(
        [ServiceBinding(rollout_pb2_grpc.add_RolloutServicer_to_server, servicer, "physarum.v1.Rollout")],
        config.host, config.port, serving=False, token=auth.read_token("rollout"), service="rollout")
    rest_server = RestServer(rest.create_app(pool, registry.metrics), config.host, config.rest_port)
    await rest_server.start()
    pool.rest_url = f"http://{config.host}:{rest_server.port}"
    log.info("rollout manager REST API on %s (scale, engines, metrics)", pool.rest_url)

    async def start_pool() -> None:
        await pool.start()
        pool_ready.set()
        grpc_server.set_serving(True)
        log.info("rollout manager serving on %s:%d: %d engines behind router %s", config.host, grpc_server.port,
                 len(pool.records), config.router_url)

    return RolloutServer(grpc=grpc_server, rest=rest_server, gateway=gateway_server, manager=manager, pool=pool,
                         pool_start=asyncio.create_task(start_pool()), clients=[buffer, reward, router])


def build_launcher(config: RolloutManagerConfig, work_dir: Path) -> EngineLauncher | None:
    """The engines' launcher: local processes (CPU engines or SGLang servers) or the Kubernetes Deployment; None when
    local engines have no model (the pool then has only --engine-urls)."""
    if config.engine_launcher == "kubernetes":
        from services.rollout.pool.k8s import KubernetesEngineLauncher

        return KubernetesLauncher(KubernetesEngineLauncher(
            namespace=config.k8s_namespace, deployment=config.k8s_engine_deployment,
            label_selector=config.k8s_engine_selector, engine_port=config.k8s_engine_port))
    if not config.model_path:
        return None
    if config.engine_type == "sglang":
        options = parse_sglang_options(config.sglang_args)
        argv = lambda port, index: sglang_server_argv(config.model_path, "127.0.0.1", port, options)  # noqa: E731
    else:
        argv = cpu_engine_argv(config.model_path, num_threads=config.engine_num_threads,
                               per_token_delay_s=config.engine_per_token_delay_s,
                               fake_compute=config.engine_fake_compute,
                               weight_sync_timeout_s=config.engine_weight_sync_timeout_s,
                               device=config.engine_device)
    return LocalLauncher(argv, work_dir, env=auth.engine_env(work_dir / "engine-token"),
                         options_argv=sglang_server_args if config.engine_type == "sglang" else cpu_engine_options_argv)
