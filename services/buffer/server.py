"""The buffer's gRPC servicer: proto <-> dataclasses around one BufferStore call per RPC."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from dataclasses import dataclass, field

from services.buffer.client import state_from_proto, state_to_proto
from services.buffer.config import BufferConfig
from services.buffer.dataset import read_prompts
from services.buffer.metrics import BufferMetrics, MeteredStore, MetricsExporter, start_exporter
from services.buffer.store import BufferStore
from services.common import auth
from services.common.errors import Unavailable
from services.common.gen.physarum.v1 import buffer_pb2, buffer_pb2_grpc, sample_pb2
from services.common.grpc_server import GrpcServer, ServiceBinding, handle_errors, start_grpc_server, stop_grpc_server
from services.common.samples import EncodedGroup, encoded_group_from_proto, prompt_from_proto, prompt_to_proto
from services.common.shares import Share

log = logging.getLogger(__name__)


class BufferServicer(buffer_pb2_grpc.BufferServicer):
    def __init__(self, store: BufferStore, data_roots: list[str]) -> None:
        self.store = store
        self.data_roots = data_roots

    @handle_errors
    async def LoadDataset(self, request, context):
        read = functools.partial(read_prompts, request.path, input_key=request.input_key or "input",
                                 label_key=request.label_key, metadata_key=request.metadata_key or "metadata",
                                 apply_chat_template=request.apply_chat_template, roots=self.data_roots,
                                 multimodal_keys=dict(request.multimodal_keys))
        info = await self.store.load_dataset(request.job_id, read, shuffle=request.rollout_shuffle,
                                             seed=request.rollout_seed, path=request.path)
        return buffer_pb2.LoadDatasetResponse(num_prompts=info.num_prompts, num_skipped=info.num_skipped,
                                              errors=info.errors, already_loaded=info.already_loaded)

    @handle_errors
    async def LeasePrompts(self, request, context):
        prompts = await self.store.lease(request.job_id, request.rollout_id, request.count, request.lease_timeout_s)
        return buffer_pb2.LeasePromptsResponse(prompts=[prompt_to_proto(p) for p in prompts])

    @handle_errors
    async def ReturnPrompts(self, request, context):
        num_returned = await self.store.return_prompts(request.job_id, list(request.lease_ids))
        return buffer_pb2.ReturnPromptsResponse(num_returned=num_returned)

    @handle_errors
    async def PutGroups(self, request, context):
        # encoded groups are stored as the bytes they came in; a writer that sends messages has them serialized here
        groups = [encoded_group_from_proto(g) for g in request.groups]
        groups += [encoded_group_from_wire(g) for g in request.encoded_groups]
        num_written, num_duplicate = await self.store.put_groups(groups)
        return buffer_pb2.PutGroupsResponse(num_written=num_written, num_duplicate=num_duplicate)

    @handle_errors
    async def GetBatch(self, request, context):
        payloads = await self.store.get_batch_encoded(request.job_id, request.rollout_id, request.num_groups,
                                                      request.timeout_s, share_from_proto(request.share))
        if request.encoded:
            return buffer_pb2.GetBatchResponse(encoded_groups=payloads)
        return buffer_pb2.GetBatchResponse(groups=[served_group(p, request.rollout_id) for p in payloads])

    @handle_errors
    async def TakeBatch(self, request, context):
        payloads, dropped, regenerated = await self.store.take_batch_encoded(
            request.job_id, request.rollout_id, request.num_groups, min_weight_version=request.min_weight_version,
            stale_policy=request.stale_policy or "regenerate", timeout_s=request.timeout_s,
            max_weight_version=request.max_weight_version, share=share_from_proto(request.share))
        reply = buffer_pb2.TakeBatchResponse(num_stale_dropped=dropped, num_stale_regenerated=regenerated)
        if request.encoded:
            reply.encoded_groups.extend(payloads)
        else:
            reply.groups.extend(served_group(p, request.rollout_id) for p in payloads)
        return reply

    @handle_errors
    async def CountGroups(self, request, context):
        num_groups = await self.store.count_groups(request.job_id, request.rollout_id)
        return buffer_pb2.CountGroupsResponse(num_groups=num_groups)

    @handle_errors
    async def GetStats(self, request, context):
        stats = await self.store.stats(request.job_id)
        return buffer_pb2.BufferStats(num_prompts=stats.num_prompts, epoch=stats.epoch, cursor=stats.cursor,
                                      num_leased=stats.num_leased, num_returned=stats.num_returned,
                                      num_groups=stats.num_groups)

    @handle_errors
    async def SaveState(self, request, context):
        return state_to_proto(await self.store.save_state(request.job_id, request.rollout_id))

    @handle_errors
    async def RestoreState(self, request, context):
        num_requeued, num_dropped = await self.store.restore_state(request.job_id, state_from_proto(request.state))
        return buffer_pb2.RestoreStateResponse(num_requeued=num_requeued, num_leases_dropped=num_dropped)

    @handle_errors
    async def AppendPrompts(self, request, context):
        num_appended, num_prompts = await self.store.append_prompts(
            request.job_id, request.position, [prompt_from_proto(p) for p in request.prompts])
        return buffer_pb2.AppendPromptsResponse(num_appended=num_appended, num_prompts=num_prompts)

    @handle_errors
    async def SaveSourcePosition(self, request, context):
        await self.store.save_source_position(request.job_id, request.rollout_id, request.position)
        return buffer_pb2.SourcePosition(position=request.position, found=True)

    @handle_errors
    async def LoadSourcePosition(self, request, context):
        position = await self.store.load_source_position(request.job_id, request.rollout_id)
        return buffer_pb2.SourcePosition(position=position or 0, found=position is not None)


def encoded_group_from_wire(msg: buffer_pb2.EncodedGroup) -> EncodedGroup:
    """An encoded group as its writer sent it: indexed by its header (the store checks the bytes are that group)."""
    h = msg.header
    return EncodedGroup(h.group_id, h.job_id, h.rollout_id, h.prompt_index, h.epoch, h.lease_id,
                        (h.oldest_weight_version, h.newest_weight_version), msg.sample_group, h.num_tokens)


def served_group(payload: bytes, rollout_id: int) -> sample_pb2.SampleGroup:
    """A stored group as a message, for a reader that did not ask for the bytes: it belongs to `rollout_id`."""
    msg = sample_pb2.SampleGroup.FromString(payload)
    msg.rollout_id = rollout_id
    return msg


def share_from_proto(msg: buffer_pb2.Share) -> Share:
    """An unset share (count 0) is the whole rollout."""
    return Share(index=msg.index, count=msg.count or 1, step_groups=msg.step_groups)


REDIS_CHECK_S = 1.0  # how often health follows Redis (busy with a script, loading its data, gone)


@dataclass
class BufferServer(GrpcServer):
    """The running server, the store it closes on stop and the task that keeps health in step with Redis."""

    store: BufferStore = field(kw_only=True)
    metrics: MetricsExporter | None = field(default=None, kw_only=True)  # with config.metrics_port
    watcher: asyncio.Task | None = None


async def _follow_redis(server: BufferServer) -> None:
    """Health is NOT_SERVING while Redis does not answer PING (BUSY, LOADING, unreachable), SERVING once it does."""
    serving = True
    while True:
        await asyncio.sleep(REDIS_CHECK_S)
        why = await server.store.ping(timeout_s=max(REDIS_CHECK_S, 2.0))
        if (why is None) != serving:
            serving = why is None
            if serving:
                log.info("Redis %s answers again: SERVING", server.store.where)
            else:
                log.warning("Redis %s cannot answer (%s): NOT_SERVING", server.store.where, why)
            await server.set_serving(serving)


async def create_server(config: BufferConfig) -> BufferServer:
    """Start the server NOT_SERVING, wait (bounded) for Redis, then report SERVING."""
    store = MeteredStore(config.redis_url, BufferMetrics())
    binding = ServiceBinding(buffer_pb2_grpc.add_BufferServicer_to_server, BufferServicer(store, config.data_roots),
                             "physarum.v1.Buffer")
    grpc_server = await start_grpc_server([binding], config.host, config.port, serving=False,
                                          token=auth.read_token("buffer"), service="buffer")
    server = BufferServer(**vars(grpc_server), store=store)
    try:
        await store.wait_ready(config.redis_wait_s)
    except Unavailable:
        await stop_server(server, grace_s=0)
        raise
    if config.metrics_port:
        server.metrics = await start_exporter(store, config.host, config.metrics_port, config.metrics_interval_s)
    await server.set_serving(True)
    server.watcher = asyncio.create_task(_follow_redis(server))
    if not config.data_roots:
        log.warning("data_roots is empty: LoadDataset reads any path this process can (set it outside local runs)")
    log.info("buffer serving on %s:%d, Redis %s", config.host, server.port, store.where)
    return server


async def stop_server(server: BufferServer, grace_s: float) -> None:
    """Stop serving (NOT_SERVING first, in-flight calls get grace_s), then close the Redis connections."""
    if server.watcher is not None:
        server.watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await server.watcher
    await stop_grpc_server(server, grace_s)
    if server.metrics:
        await server.metrics.stop()
    await server.store.close()
