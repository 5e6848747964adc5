"""The trainer's servers: gRPC Jobs and the REST job API, over one job registry."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2

from services.common import auth
from services.common.errors import InvalidArgument
from services.common.gen.physarum.v1 import jobs_pb2, jobs_pb2_grpc
from services.common.grpc_server import GrpcServer, ServiceBinding, handle_errors, start_grpc_server
from services.common.rest import RestServer
from services.common.samples import dict_to_struct, struct_to_dict
from services.trainer.api.auth import check_bearer
from services.trainer.api.config import TrainerConfig
from services.trainer.api.jobs import Job, JobEvent, JobRegistry, JobState, Runner
from services.trainer.api.preflight import with_preflight
from services.trainer.api.rest import create_app
from services.trainer.api.spec import parse_spec
from services.trainer.api.spec_defaults import SpecParser, path_roots, spec_defaults, spec_parser
from services.trainer.dashboard.api import mount_dashboard
from services.trainer.driver.sample_board import SampleBoard

log = logging.getLogger(__name__)

EVENT_POLL_S = 0.2
HEALTH_POLL_S = 1.0
QUEUE_HEALTH = "physarum.v1.Jobs.queue"  # a health service name of its own: SERVING unless the job queue is stuck
# On SIGTERM, after the job stopped (preempt_timeout_s): seconds the job records get to reach Redis. With the gRPC
# grace (grace_s) this is what the stop needs beyond preempt_timeout_s; the chart leaves 15 s for it.
RECORDS_TIMEOUT_S = 5.0


def job_to_proto(job: Job) -> jobs_pb2.Job:
    return jobs_pb2.Job(job_id=job.job_id, state=jobs_pb2.JobState.Value(f"JOB_STATE_{job.state.value}"),
                        spec=dict_to_struct(job.spec.model_dump()), rollout_id=job.rollout_id,
                        num_rollout=job.spec.num_rollout, metrics=job.metrics, error=job.error,
                        created_at=job.created_at, finished_at=job.finished_at, attempts=job.attempts,
                        checkpoints=job.checkpoints)


def event_to_proto(event: JobEvent) -> jobs_pb2.JobEvent:
    return jobs_pb2.JobEvent(job_id=event.job_id, seq=event.seq,
                             state=jobs_pb2.JobState.Value(f"JOB_STATE_{event.state.value}"),
                             rollout_id=event.rollout_id, metrics=event.metrics, message=event.message,
                             time=event.time)


def spec_from_struct(spec: struct_pb2.Struct) -> dict:
    """A submitted spec as a dict; a value JSON cannot hold (NaN, an infinity) is InvalidArgument, not INTERNAL."""
    try:
        return struct_to_dict(spec)
    except ValueError as err:  # protobuf's json_format: "Fail to serialize NaN for Value.number_value, ..."
        raise InvalidArgument(f"job spec: {str(err).split(',')[0]} (send finite numbers)") from None


class JobsServicer(jobs_pb2_grpc.JobsServicer):
    def __init__(self, registry: JobRegistry, api_token: str = "", parse: SpecParser = parse_spec) -> None:
        self.registry = registry
        self.api_token = api_token
        self.parse = parse  # parse_spec with the trainer's spec defaults

    def _authorize(self, context) -> None:
        metadata = dict(context.invocation_metadata() or ())
        check_bearer(metadata.get("authorization"), self.api_token)

    @handle_errors
    async def SubmitJob(self, request, context):
        self._authorize(context)
        job = self.registry.submit(self.parse(spec_from_struct(request.spec)))
        reply = job_to_proto(job)
        reply.job_token = job.token  # the job's own token, given this once (it opens the job's REST paths)
        return reply

    @handle_errors
    async def GetJob(self, request, context):
        self._authorize(context)
        return job_to_proto(self.registry.get(request.job_id))

    @handle_errors
    async def ListJobs(self, request, context):
        self._authorize(context)
        state = JobState(jobs_pb2.JobState.Name(request.state).removeprefix("JOB_STATE_")) if request.state else None
        return jobs_pb2.ListJobsResponse(jobs=[job_to_proto(j) for j in self.registry.list(state)])

    @handle_errors
    async def CancelJob(self, request, context):
        self._authorize(context)
        return job_to_proto(self.registry.cancel(request.job_id))

    @handle_errors
    async def StreamEvents(self, request, context):
        self._authorize(context)
        after = request.after_seq
        while True:
            for event in self.registry.events_after(request.job_id, after):
                after = event.seq
                yield event_to_proto(event)
            if self.registry.get(request.job_id).state.terminal and not self.registry.events_after(
                    request.job_id, after):
                return
            await asyncio.sleep(EVENT_POLL_S)


async def watch_health(grpc_server: GrpcServer, registry: JobRegistry) -> None:
    """gRPC health follows the job queue: NOT_SERVING while its worker is stuck, overall (readiness) and under
    QUEUE_HEALTH, which only a stuck queue turns NOT_SERVING (the chart's liveness probe: a restart resumes the
    jobs), not a drain."""
    serving = True
    await grpc_server.health.set(QUEUE_HEALTH, health_pb2.HealthCheckResponse.SERVING)
    while True:
        reason = registry.health()
        if serving != (not reason):
            serving = not reason
            if reason:
                log.error("job queue stuck: %s", reason)
            await grpc_server.set_serving(serving)
            await grpc_server.health.set(QUEUE_HEALTH, health_pb2.HealthCheckResponse.SERVING if serving
                                         else health_pb2.HealthCheckResponse.NOT_SERVING)
        await asyncio.sleep(HEALTH_POLL_S)


@dataclass
class TrainerServers:
    grpc: GrpcServer
    rest: RestServer
    registry: JobRegistry
    health_task: asyncio.Task

    async def stop(self, grace_s: float, preempt_timeout_s: float = 30.0) -> None:
        self.health_task.cancel()
        await self.grpc.set_serving(False)  # draining: unready (the queue's own health, liveness, stays SERVING)
        # the running job checkpoints at its next safe point and stops; then the records are written
        await asyncio.to_thread(self.registry.close, preempt_timeout_s, RECORDS_TIMEOUT_S)
        await self.rest.stop()
        await self.grpc.server.stop(grace_s)


async def create_server(config: TrainerConfig, runner: Runner, board: SampleBoard | None = None) -> TrainerServers:
    """The job API over `runner`; the dashboard shows the samples the driver records on `board`."""
    store = None
    if config.jobs_redis_url:
        from services.trainer.api.job_store import RedisJobStore

        store = await asyncio.to_thread(RedisJobStore, config.jobs_redis_url)
    registry = await asyncio.to_thread(JobRegistry, runner, store, config.job_max_restarts,  # waits for Redis
                                       config.world_size == 1)
    # refuse what would fail on GPUs
    parse = with_preflight(spec_parser(spec_defaults(config), path_roots(config)), config.world_size)
    token = config.api_token or auth.read_token("trainer")  # the token file: no secret in flags or environment
    grpc_server = await start_grpc_server(
        [ServiceBinding(jobs_pb2_grpc.add_JobsServicer_to_server, JobsServicer(registry, token, parse),
                       "physarum.v1.Jobs")],
        config.host, config.port, token=token, service="trainer")  # checked before a request is even decoded
    app = create_app(registry, token, parse)
    mount_dashboard(app, registry, board or SampleBoard(), rollout_addr=config.rollout_addr,
                    buffer_addr=config.buffer_addr)
    rest = RestServer(app, config.host, config.rest_port)
    await rest.start()
    return TrainerServers(grpc=grpc_server, rest=rest, registry=registry,
                          health_task=asyncio.create_task(watch_health(grpc_server, registry)))
