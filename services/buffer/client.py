"""A synchronous client of the buffer service; every call has a deadline, idempotent calls retry.

Its result types (DatasetInfo, PutResult, TakenBatch, BufferStats, DataSourceState) are the buffer's public records;
it imports only services.common, so callers never pull in Redis.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.common.gen.physarum.v1 import buffer_pb2, buffer_pb2_grpc, sample_pb2
from services.common.grpc_client import GrpcClient
from services.common.samples import (
    EncodedGroup,
    Prompt,
    SampleGroup,
    encode_group,
    group_from_proto,
    prompt_from_proto,
    prompt_to_proto,
)
from services.common.shares import Share

STREAM_ROLLOUT_ID = -2  # the rollout id of a fully_async manager's stream (groups not yet taken)
LOAD_TIMEOUT_S = 300.0  # reading and storing a large dataset takes longer than an ordinary call


@dataclass
class DatasetInfo:
    num_prompts: int
    num_skipped: int
    errors: list[str]
    already_loaded: bool


@dataclass
class PutResult:
    num_written: int
    num_duplicate: int


@dataclass
class TakenBatch:
    groups: list[SampleGroup] | list[bytes]  # bytes from take_batch_encoded
    num_stale_dropped: int  # the job's totals so far
    num_stale_regenerated: int


@dataclass
class BufferStats:
    num_prompts: int
    epoch: int
    cursor: int
    num_leased: int
    num_returned: int
    num_groups: int


@dataclass
class DataSourceState:
    """Where a job's data source stands (slime's global_dataset_state_dict): the epoch cursor and the slots
    ("epoch:index") to serve before it. Saved into the trainer's checkpoints as JSON."""

    num_prompts: int
    shuffle: bool
    seed: int
    epoch: int
    cursor: int
    returned: list[str] = field(default_factory=list)  # waiting to be leased again, in queue order
    leased: list[str] = field(default_factory=list)  # leased and not yet written, in lease order
    pending: list[str] = field(default_factory=list)  # written for rollouts after rollout_id, not yet trained on
    rollout_id: int = -1  # the last rollout trained on when the state was saved
    generated: bool = False  # the prompts are a data source's own (AppendPrompts), not a file's

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DataSourceState:
        return cls(**data)


def group_header(group: EncodedGroup) -> buffer_pb2.GroupHeader:
    """What the buffer indexes `group` by, sent beside its bytes."""
    oldest, newest = group.weight_version_range
    return buffer_pb2.GroupHeader(group_id=group.group_id, job_id=group.job_id, rollout_id=group.rollout_id,
                                  prompt_index=group.prompt_index, epoch=group.epoch, lease_id=group.lease_id,
                                  oldest_weight_version=oldest, newest_weight_version=newest,
                                  num_tokens=group.num_tokens)


def decode_served_group(payload: bytes, rollout_id: int) -> SampleGroup:
    """A group the buffer served for `rollout_id` (it carries that id beside the group's bytes: a stream group
    holds the id it was written with)."""
    group = group_from_proto(sample_pb2.SampleGroup.FromString(payload))
    group.rollout_id = rollout_id
    return group


def share_to_proto(share: Share) -> buffer_pb2.Share:
    return buffer_pb2.Share(index=share.index, count=share.count, step_groups=share.step_groups)


def state_to_proto(state: DataSourceState) -> buffer_pb2.DataSourceState:
    return buffer_pb2.DataSourceState(**state.to_dict())


def state_from_proto(msg: buffer_pb2.DataSourceState) -> DataSourceState:
    return DataSourceState(num_prompts=msg.num_prompts, shuffle=msg.shuffle, seed=msg.seed, epoch=msg.epoch,
                           cursor=msg.cursor, returned=list(msg.returned), leased=list(msg.leased),
                           pending=list(msg.pending), rollout_id=msg.rollout_id,
                           generated=msg.generated)


class BufferClient(GrpcClient):
    service = "buffer"

    def __init__(self, addr: str, timeout_s: float = 10.0, max_retries: int = 3, **options: float) -> None:
        super().__init__(addr, timeout_s, max_retries, **options)
        self.stub = buffer_pb2_grpc.BufferStub(self.channel)

    def load_dataset(self, job_id: str, path: str, *, input_key: str = "input", label_key: str = "",
                     metadata_key: str = "metadata", apply_chat_template: bool = False,
                     rollout_shuffle: bool = False, rollout_seed: int = 42,
                     multimodal_keys: dict[str, str] | None = None) -> DatasetInfo:
        request = buffer_pb2.LoadDatasetRequest(
            job_id=job_id, path=path, input_key=input_key, label_key=label_key, metadata_key=metadata_key,
            apply_chat_template=apply_chat_template, rollout_shuffle=rollout_shuffle, rollout_seed=rollout_seed,
            multimodal_keys=multimodal_keys or {})
        reply = self.call(self.stub.LoadDataset, request, timeout_s=max(self.timeout_s, LOAD_TIMEOUT_S),
                          idempotent=True)
        return DatasetInfo(num_prompts=reply.num_prompts, num_skipped=reply.num_skipped, errors=list(reply.errors),
                           already_loaded=reply.already_loaded)

    def lease_prompts(self, job_id: str, rollout_id: int, count: int, lease_timeout_s: float) -> list[Prompt]:
        """Retried like an idempotent call: a retry after a lost reply leaves that reply's leases unused, and they
        expire (their prompts served again), so a buffer that restarts loses no prompt and stops no rollout."""
        request = buffer_pb2.LeasePromptsRequest(job_id=job_id, rollout_id=rollout_id, count=count,
                                                 lease_timeout_s=lease_timeout_s)
        return [prompt_from_proto(p) for p in self.call(self.stub.LeasePrompts, request, idempotent=True).prompts]

    def return_prompts(self, job_id: str, lease_ids: list[str]) -> int:
        request = buffer_pb2.ReturnPromptsRequest(job_id=job_id, lease_ids=lease_ids)
        return self.call(self.stub.ReturnPrompts, request, idempotent=True).num_returned

    def put_groups(self, groups: list[SampleGroup] | list[EncodedGroup]) -> PutResult:
        """Store groups: SampleGroups are encoded here, once; EncodedGroups go as the bytes they hold."""
        encoded = [g if isinstance(g, EncodedGroup) else encode_group(g) for g in groups]
        request = buffer_pb2.PutGroupsRequest(encoded_groups=[
            buffer_pb2.EncodedGroup(header=group_header(g), sample_group=g.payload) for g in encoded])
        reply = self.call(self.stub.PutGroups, request, idempotent=True)
        return PutResult(num_written=reply.num_written, num_duplicate=reply.num_duplicate)

    def get_batch(self, job_id: str, rollout_id: int, num_groups: int, timeout_s: float,
                  share: Share = Share()) -> list[SampleGroup]:
        """The first num_groups groups of the rollout (or `share`'s part of them), waiting up to timeout_s for them
        to be written."""
        return [decode_served_group(g, rollout_id)
                for g in self.get_batch_encoded(job_id, rollout_id, num_groups, timeout_s, share)]

    def get_batch_encoded(self, job_id: str, rollout_id: int, num_groups: int, timeout_s: float,
                          share: Share = Share()) -> list[bytes]:
        """get_batch's groups as the buffer stores them: serialized SampleGroups, each holding the rollout id it was
        written with (a stream group's is -2: it belongs to `rollout_id` all the same)."""
        request = buffer_pb2.GetBatchRequest(job_id=job_id, rollout_id=rollout_id, num_groups=num_groups,
                                             timeout_s=timeout_s, share=share_to_proto(share), encoded=True)
        reply = self.call(self.stub.GetBatch, request, timeout_s=timeout_s + self.timeout_s, idempotent=True)
        return list(reply.encoded_groups)

    def take_batch(self, job_id: str, rollout_id: int, num_groups: int, *, min_weight_version: int,
                   stale_policy: str = "regenerate", timeout_s: float, max_weight_version: int = -1,
                   share: Share = Share()) -> TakenBatch:
        """fully_async: the rollout's num_groups groups (or `share`'s part of them), taken from the job's stream
        (only those whose tokens' versions lie in [min_weight_version, max_weight_version]); repeated calls for a
        rollout return the same."""
        taken = self.take_batch_encoded(job_id, rollout_id, num_groups, min_weight_version=min_weight_version,
                                        stale_policy=stale_policy, timeout_s=timeout_s,
                                        max_weight_version=max_weight_version, share=share)
        taken.groups = [decode_served_group(g, rollout_id) for g in taken.groups]
        return taken

    def take_batch_encoded(self, job_id: str, rollout_id: int, num_groups: int, *, min_weight_version: int,
                           stale_policy: str = "regenerate", timeout_s: float, max_weight_version: int = -1,
                           share: Share = Share()) -> TakenBatch:
        """take_batch, its groups as the buffer stores them (serialized SampleGroups, as in get_batch_encoded)."""
        request = buffer_pb2.TakeBatchRequest(job_id=job_id, rollout_id=rollout_id, num_groups=num_groups,
                                              min_weight_version=min_weight_version, stale_policy=stale_policy,
                                              timeout_s=timeout_s, max_weight_version=max_weight_version,
                                              share=share_to_proto(share), encoded=True)
        reply = self.call(self.stub.TakeBatch, request, timeout_s=timeout_s + self.timeout_s, idempotent=True)
        return TakenBatch(groups=list(reply.encoded_groups), num_stale_dropped=reply.num_stale_dropped,
                          num_stale_regenerated=reply.num_stale_regenerated)

    def count_groups(self, job_id: str, rollout_id: int) -> int:
        request = buffer_pb2.CountGroupsRequest(job_id=job_id, rollout_id=rollout_id)
        return self.call(self.stub.CountGroups, request, idempotent=True).num_groups

    def stats(self, job_id: str) -> BufferStats:
        reply = self.call(self.stub.GetStats, buffer_pb2.GetStatsRequest(job_id=job_id), idempotent=True)
        return BufferStats(num_prompts=reply.num_prompts, epoch=reply.epoch, cursor=reply.cursor,
                           num_leased=reply.num_leased, num_returned=reply.num_returned, num_groups=reply.num_groups)

    def save_state(self, job_id: str, rollout_id: int) -> DataSourceState:
        """The job's data-source state after training on rollout `rollout_id` (one atomic snapshot)."""
        request = buffer_pb2.SaveStateRequest(job_id=job_id, rollout_id=rollout_id)
        return state_from_proto(self.call(self.stub.SaveState, request, idempotent=True))

    def restore_state(self, job_id: str, state: DataSourceState) -> tuple[int, int]:
        """Put the job's data source back to `state`; returns (num_requeued, num_leases_dropped)."""
        request = buffer_pb2.RestoreStateRequest(job_id=job_id, state=state_to_proto(state))
        reply = self.call(self.stub.RestoreState, request, idempotent=True)
        return reply.num_requeued, reply.num_leases_dropped

    def append_prompts(self, job_id: str, position: int, prompts: list[Prompt]) -> tuple[int, int]:
        """Store a data source's own prompts at positions position, position + 1, ...; idempotent (a position stored
        already keeps its first prompt). Returns (num_appended, num_prompts)."""
        request = buffer_pb2.AppendPromptsRequest(job_id=job_id, position=position,
                                                  prompts=[prompt_to_proto(p) for p in prompts])
        reply = self.call(self.stub.AppendPrompts, request, idempotent=True)
        return reply.num_appended, reply.num_prompts

    def save_source_position(self, job_id: str, rollout_id: int, position: int) -> None:
        """How many prompts the job's data source had yielded when it saved its state for `rollout_id`."""
        request = buffer_pb2.SourcePositionRequest(job_id=job_id, rollout_id=rollout_id, position=position)
        self.call(self.stub.SaveSourcePosition, request, idempotent=True)

    def load_source_position(self, job_id: str, rollout_id: int) -> int:
        """The position save_source_position stored for `rollout_id`; 0 when none was (a source loads fresh)."""
        request = buffer_pb2.SourcePositionRequest(job_id=job_id, rollout_id=rollout_id)
        return self.call(self.stub.LoadSourcePosition, request, idempotent=True).position
