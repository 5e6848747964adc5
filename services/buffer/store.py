"""The buffer's state in Redis: datasets, the epoch cursor, prompt leases and finished sample groups.

Every key of a job starts with `physarum:{<job_id>}:` (one Redis Cluster hash slot per job). Multi-key updates
run as Lua scripts, so any number of buffer replicas can share one Redis. Knows nothing of gRPC.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import re
import struct
import time
import uuid
from collections.abc import Callable
from dataclasses import replace

import redis.asyncio as redis
from google.protobuf.message import DecodeError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError as RedisResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from services.buffer.client import STREAM_ROLLOUT_ID, BufferStats, DatasetInfo, DataSourceState
from services.buffer.dataset import PromptRows
from services.buffer.scripts import (
    APPEND_PROMPTS,
    FINISH_LOAD,
    LEASE,
    PUT_GROUPS,
    READ_GROUP_IDS,
    RESTORE_STATE,
    RETURN,
    SAVE_STATE,
    SET_ORDER,
    STATS,
    TAKE,
)
from services.common import bounds
from services.common.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, NotFound, Unavailable
from services.common.gen.physarum.v1 import sample_pb2
from services.common.samples import (
    EncodedGroup,
    Prompt,
    SampleGroup,
    encode_group,
    group_id_for,
    prompt_from_proto,
    prompt_to_proto,
)
from services.common.shares import Share, share_positions

log = logging.getLogger(__name__)

POLL_S = 0.05             # get_batch's polling interval
LOAD_CHUNK = 2000         # prompts per HSET while loading
LOAD_TTL_S = 3600         # a half-written dataset (a replica died while loading) expires after this
SOCKET_TIMEOUT_S = 30.0
STALE_POLICIES = ("regenerate", "drop")
# Upper bounds on what one call may ask for: each bounds the work of one Lua script, which blocks the whole Redis.
MAX_ITEMS_PER_CALL = 16384    # prompts leased, lease ids returned, groups written or read
MAX_ROLLOUT_ID = 2**31 - 1    # Lua numbers are doubles: far below 2^53, so ids compare exactly
MAX_WEIGHT_VERSION = 2**31 - 1
MAX_LEASE_TIMEOUT_S = 7 * 86400.0
_TRANSIENT_REPLIES = ("BUSY", "LOADING", "MASTERDOWN", "TRYAGAIN", "OOM")  # Redis will answer again later


def _prefix(job_id: str) -> str:
    return f"physarum:{{{bounds.dataset_key(job_id)}}}:"


def _rollout_id(value: int, low: int = -1) -> int:
    return bounds.integer("rollout_id", value, low, MAX_ROLLOUT_ID)


def _count(name: str, value: int) -> int:
    return bounds.integer(name, value, 1, MAX_ITEMS_PER_CALL)


def _redis_errors(method: Callable) -> Callable:
    """Redis connection failures, and replies that say Redis is busy (a long script) or loading its data, become
    Unavailable (clients retry idempotent calls on it)."""
    @functools.wraps(method)
    async def wrapper(self: BufferStore, *args, **kwargs):
        try:
            return await method(self, *args, **kwargs)
        except (RedisConnectionError, RedisTimeoutError) as err:
            raise Unavailable(f"buffer: Redis {self.where} unreachable: {err}") from None
        except RedisResponseError as err:
            if str(err).startswith(_TRANSIENT_REPLIES):
                raise Unavailable(f"buffer: Redis {self.where} cannot answer now: {err}") from None
            raise
    return wrapper


class BufferStore:
    def __init__(self, redis_url: str) -> None:
        self.where = re.sub(r"//[^@/]*@", "//***@", redis_url)  # no password in messages
        self.redis = redis.Redis.from_url(redis_url, socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=5.0)
        self._scripts = {name: self.redis.register_script(text) for name, text in [
            ("finish_load", FINISH_LOAD), ("lease", LEASE), ("set_order", SET_ORDER), ("return", RETURN),
            ("put_groups", PUT_GROUPS), ("read_group_ids", READ_GROUP_IDS), ("stats", STATS),
            ("save_state", SAVE_STATE), ("restore_state", RESTORE_STATE), ("take", TAKE),
            ("append_prompts", APPEND_PROMPTS)]}

    async def wait_ready(self, timeout_s: float) -> None:
        """Ping Redis until it answers; Unavailable after timeout_s."""
        deadline = time.monotonic() + timeout_s
        delay_s = 0.1
        while True:
            try:
                await self.redis.ping()
                return
            except (RedisConnectionError, RedisTimeoutError, OSError) as err:
                if time.monotonic() + delay_s > deadline:
                    raise Unavailable(f"buffer: Redis {self.where}: no answer after {timeout_s} s ({err})") from None
                log.info("waiting for Redis %s: %s", self.where, err)
            await asyncio.sleep(delay_s)
            delay_s = min(1.0, delay_s * 2)

    async def ping(self, timeout_s: float) -> str | None:
        """None when Redis answers PING within timeout_s, else why not (busy, loading, unreachable)."""
        try:
            await asyncio.wait_for(self.redis.ping(), timeout_s)
            return None
        except (RedisConnectionError, RedisTimeoutError, RedisResponseError, OSError, TimeoutError) as err:
            return f"{type(err).__name__}: {err}"

    async def close(self) -> None:
        await self.redis.aclose()

    async def _run(self, name: str, *args: object):
        return await self._scripts[name](args=args)

    # ----- datasets -----

    @_redis_errors
    async def load_dataset(self, job_id: str, read: Callable[[], PromptRows], *, shuffle: bool, seed: int,
                           path: str) -> DatasetInfo:
        """Store the rows `read()` returns (run in a thread), once per job; later calls are no-ops."""
        p = _prefix(job_id)
        if (info := await self._loaded_info(p)) is not None:
            return info
        rows = await asyncio.to_thread(read)
        tmp = f"{p}loading:{uuid.uuid4().hex}"
        payloads = [prompt_to_proto(replace(prompt, job_id=job_id, index=i)).SerializeToString()
                    for i, prompt in enumerate(rows.prompts)]
        for start in range(0, len(payloads), LOAD_CHUNK):
            chunk = payloads[start:start + LOAD_CHUNK]
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.hset(tmp, mapping={str(start + i): payload for i, payload in enumerate(chunk)})
                pipe.expire(tmp, LOAD_TTL_S)
                await pipe.execute()
        if not await self._run("finish_load", p, tmp, len(payloads), int(shuffle), seed, rows.num_skipped, path):
            return await self._loaded_info(p)  # another replica loaded it first
        log.info("job %s: loaded %d prompts from %s (%d rows skipped, shuffle=%s, seed=%d)", job_id,
                 len(payloads), path, rows.num_skipped, shuffle, seed)
        return DatasetInfo(num_prompts=len(payloads), num_skipped=rows.num_skipped, errors=rows.errors,
                           already_loaded=False)

    async def _loaded_info(self, p: str) -> DatasetInfo | None:
        num_prompts, num_skipped = await self.redis.hmget(p + "meta", ["num_prompts", "num_skipped"])
        if num_prompts is None:
            return None
        return DatasetInfo(num_prompts=int(num_prompts), num_skipped=int(num_skipped), errors=[],
                           already_loaded=True)

    @_redis_errors
    async def append_prompts(self, job_id: str, position: int, prompts: list[Prompt]) -> tuple[int, int]:
        """Store a data source's prompts as those of indices position, position + 1, ... (an index stored already
        keeps its first copy). Returns (num_appended, num_prompts)."""
        bounds.integer("position", position, 0, bounds.INT64_MAX)
        if len(prompts) > MAX_ITEMS_PER_CALL:
            raise InvalidArgument(f"prompts: at most {MAX_ITEMS_PER_CALL} per call, got {len(prompts)}")
        payloads = [prompt_to_proto(replace(prompt, job_id=job_id, index=position + i, epoch=0, lease_id=""))
                    .SerializeToString() for i, prompt in enumerate(prompts)]
        appended, num_prompts = await self._run("append_prompts", _prefix(job_id), position, *payloads)
        if appended == -1:
            raise FailedPrecondition(f"buffer: job {job_id!r} serves a dataset loaded from a file ({num_prompts} "
                                     "prompts, some leased already); its data source cannot add prompts of its own")
        if appended == -2:
            raise FailedPrecondition(f"buffer: job {job_id!r}: prompts appended at position {position}, past the "
                                     f"{num_prompts} stored (a gap)")
        return int(appended), int(num_prompts)

    @_redis_errors
    async def save_source_position(self, job_id: str, rollout_id: int, position: int) -> None:
        bounds.integer("position", position, 0, bounds.INT64_MAX)
        await self.redis.hset(_prefix(job_id) + "source_positions", str(_rollout_id(rollout_id)), position)

    @_redis_errors
    async def load_source_position(self, job_id: str, rollout_id: int) -> int | None:
        value = await self.redis.hget(_prefix(job_id) + "source_positions", str(_rollout_id(rollout_id)))
        return None if value is None else int(value)

    # ----- leases -----

    @_redis_errors
    async def lease(self, job_id: str, rollout_id: int, count: int, lease_timeout_s: float) -> list[Prompt]:
        """Lease `count` prompts: returned ones first, then the epoch's order from the cursor, wrapping epochs."""
        p = _prefix(job_id)
        _rollout_id(rollout_id, low=STREAM_ROLLOUT_ID)
        _count("count", count)
        bounds.finite("lease_timeout_s", lease_timeout_s, 0.001, MAX_LEASE_TIMEOUT_S)
        batch = uuid.uuid4().hex[:16]  # ids of one call sort in lease order: equal deadlines expire in that order
        lease_ids = [f"{batch}-{i:06d}" for i in range(count)]
        timeout_ms = max(1, round(lease_timeout_s * 1000))
        for _ in range(10):  # each retry follows the creation of missing shuffle orders
            reply = await self._run("lease", p, job_id, count, timeout_ms, *lease_ids)
            if reply[0] == b"missing":
                raise NotFound(f"buffer: job {job_id!r} has no dataset (call LoadDataset first)")
            if reply[0] == b"need":
                await self._create_orders(p, [int(e) for e in reply[1:]])
                continue
            prompts = []
            for slot, lease_id, payload in zip(reply[1::3], reply[2::3], reply[3::3], strict=True):
                prompt = prompt_from_proto(sample_pb2.Prompt.FromString(payload))
                prompt.epoch, prompt.lease_id = int(slot.split(b":")[0]), lease_id.decode()
                prompts.append(prompt)
            log.debug("job %s rollout %d: leased %d prompts", job_id, rollout_id, len(prompts))
            return prompts
        raise Unavailable(f"buffer: job {job_id!r}: shuffle orders kept changing while leasing; retry")

    async def _create_orders(self, p: str, epochs: list[int]) -> None:
        """Write epoch e's order, random.Random(rollout_seed + e).shuffle(range(num_prompts)), as uint32s."""
        num_prompts, seed = (int(x) for x in await self.redis.hmget(p + "meta", ["num_prompts", "seed"]))
        for epoch in epochs:
            packed = await asyncio.to_thread(_shuffled_order, num_prompts, seed + epoch)
            await self._run("set_order", p, epoch, packed)

    @_redis_errors
    async def return_prompts(self, job_id: str, lease_ids: list[str]) -> int:
        """End leases now, their prompts to be served again; unknown lease ids are ignored (not counted)."""
        if len(lease_ids) > MAX_ITEMS_PER_CALL:
            raise InvalidArgument(f"lease_ids: at most {MAX_ITEMS_PER_CALL} per call, got {len(lease_ids)}")
        num_returned = await self._run("return", _prefix(job_id), job_id, *lease_ids)
        if num_returned < 0:
            raise NotFound(f"buffer: job {job_id!r} has no dataset")
        return num_returned

    # ----- groups -----

    @_redis_errors
    async def put_groups(self, groups: list[SampleGroup] | list[EncodedGroup]) -> tuple[int, int]:
        """Store each new group once (by group_id) and ack its lease; returns (num_written, num_duplicate)."""
        if len(groups) > MAX_ITEMS_PER_CALL:
            raise InvalidArgument(f"groups: at most {MAX_ITEMS_PER_CALL} per call, got {len(groups)}")
        args: list[object] = []
        for group in groups:
            if isinstance(group, EncodedGroup):  # a writer's bytes: checked to be the group its header names
                _check_payload(group)
        groups = [g if isinstance(g, EncodedGroup) else encode_group(g) for g in groups]
        for group in groups:
            _rollout_id(group.rollout_id, low=STREAM_ROLLOUT_ID)
            bounds.integer("epoch", group.epoch, 0, MAX_ROLLOUT_ID)
            bounds.integer("prompt_index", group.prompt_index, 0, bounds.INT64_MAX)
            expected = group_id_for(group.job_id, group.epoch, group.prompt_index)
            if group.group_id != expected:
                raise InvalidArgument(f"group {group.group_id!r}: group_id must be {expected!r} "
                                      "(job_id:epoch:prompt_index)")
            args += [_prefix(group.job_id), group.group_id, group.rollout_id, group.lease_id,
                     f"{group.epoch}:{group.prompt_index}", " ".join(map(str, group.weight_version_range)),
                     group.num_tokens, group.payload]
        if not groups:
            return 0, 0
        reply = await self._run("put_groups", *args)
        if reply[0] == -1:
            raise NotFound(f"buffer: job {groups[reply[1]].job_id!r} has no dataset")
        num_written = sum(reply)
        return num_written, len(groups) - num_written

    @_redis_errors
    async def get_batch_encoded(self, job_id: str, rollout_id: int, num_groups: int, timeout_s: float,
                                share: Share = Share()) -> list[bytes]:
        """The rollout's first num_groups groups as stored (serialized SampleGroups, each holding the rollout id it
        was written with), once that many exist (polls up to timeout_s): all of them in write order, or `share`'s in
        group_id order."""
        _rollout_id(rollout_id, low=STREAM_ROLLOUT_ID)
        _count("num_groups", num_groups)
        bounds.finite("timeout_s", timeout_s, 0.0, bounds.MAX_WAIT_S)
        deadline = time.monotonic() + timeout_s
        while True:
            have, payloads = await self._read_groups(job_id, rollout_id, num_groups, share)
            if have >= num_groups:
                return payloads
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                raise DeadlineExceeded(f"buffer: rollout {rollout_id} of job {job_id} has {have}/{num_groups} "
                                       f"groups after {timeout_s} s")
            await asyncio.sleep(min(POLL_S, left_s))

    async def _read_groups(self, job_id: str, rollout_id: int, num_groups: int,
                           share: Share = Share()) -> tuple[int, list[bytes]]:
        """How many groups the rollout has and, once it has num_groups, `share`'s part of the first num_groups as
        stored (all of them in write order when the share is whole)."""
        p = _prefix(job_id)
        reply = await self._run("read_group_ids", p, rollout_id, num_groups, 0 if share.whole else 1)
        if reply is None:
            raise NotFound(f"buffer: job {job_id!r} has no dataset")
        have, group_ids = int(reply[0]), reply[1:1 + num_groups]
        if have < num_groups:
            return have, []
        if not share.whole:
            positions = share_positions([g.decode() for g in group_ids], [int(n) for n in reply[1 + num_groups:]],
                                        share)
            group_ids = [group_ids[i] for i in positions]
        return have, await self.redis.mget([p.encode() + b"group:" + gid for gid in group_ids]) if group_ids else []

    @_redis_errors
    async def take_batch_encoded(self, job_id: str, rollout_id: int, num_groups: int, *, min_weight_version: int,
                                 stale_policy: str, timeout_s: float, max_weight_version: int = -1,
                                 share: Share = Share()) -> tuple[list[bytes], int, int]:
        """fully_async: assign stream groups whose tokens' versions lie in [min_weight_version, max_weight_version]
        (no maximum when it is < 0) to the rollout until it has num_groups, polling up to timeout_s; the others are
        dropped or regenerated.
        Returns (`share`'s part of the rollout's groups, stale dropped so far, stale regenerated so far)."""
        p = _prefix(job_id)
        _rollout_id(rollout_id, low=0)
        _count("num_groups", num_groups)
        bounds.finite("timeout_s", timeout_s, 0.0, bounds.MAX_WAIT_S)
        bounds.integer("min_weight_version", min_weight_version, -1, MAX_WEIGHT_VERSION)
        bounds.integer("max_weight_version", max_weight_version, -1, MAX_WEIGHT_VERSION)
        if stale_policy not in STALE_POLICIES:
            raise InvalidArgument(f"stale_policy must be one of {', '.join(STALE_POLICIES)}, got {stale_policy!r}")
        deadline = time.monotonic() + timeout_s
        while True:
            reply = await self._run("take", p, rollout_id, num_groups, min_weight_version, stale_policy,
                                    max_weight_version)
            if reply is None:
                raise NotFound(f"buffer: job {job_id!r} has no dataset")
            have, dropped, regenerated = (int(x) for x in reply)
            if have >= num_groups:
                _, payloads = await self._read_groups(job_id, rollout_id, num_groups, share)  # it never shrinks
                return payloads, dropped, regenerated
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                raise DeadlineExceeded(f"buffer: rollout {rollout_id} of job {job_id} has {have}/{num_groups} "
                                       f"fresh groups after {timeout_s} s")
            await asyncio.sleep(min(POLL_S, left_s))

    @_redis_errors
    async def count_groups(self, job_id: str, rollout_id: int) -> int:
        p = _prefix(job_id)
        _rollout_id(rollout_id, low=STREAM_ROLLOUT_ID)
        async with self.redis.pipeline(transaction=True) as pipe:
            exists, num_groups = await pipe.exists(p + "meta").llen(f"{p}rollout:{rollout_id}").execute()
        if not exists:
            raise NotFound(f"buffer: job {job_id!r} has no dataset")
        return num_groups

    @_redis_errors
    async def stats(self, job_id: str) -> BufferStats:
        """A consistent snapshot, after moving expired leases back to the returned queue."""
        reply = await self._run("stats", _prefix(job_id), job_id)
        if reply is None:
            raise NotFound(f"buffer: job {job_id!r} has no dataset")
        num_prompts, epoch, cursor, num_leased, num_returned, num_groups = (int(x) for x in reply)
        return BufferStats(num_prompts=num_prompts, epoch=epoch, cursor=cursor, num_leased=num_leased,
                           num_returned=num_returned, num_groups=num_groups)

    # ----- checkpoints -----

    @_redis_errors
    async def save_state(self, job_id: str, rollout_id: int) -> DataSourceState:
        """The job's data-source state, read atomically; groups of rollouts after `rollout_id` are `pending`."""
        reply = await self._run("save_state", _prefix(job_id), _rollout_id(rollout_id))
        if reply is None:
            raise NotFound(f"buffer: job {job_id!r} has no dataset")
        reply = [x.decode() if isinstance(x, bytes) else x for x in reply]
        num_returned = int(reply[5])
        num_leased = int(reply[6 + num_returned])
        leased_at = 7 + num_returned
        return DataSourceState(num_prompts=int(reply[0]), shuffle=reply[1] == "1", seed=int(reply[2]),
                               generated=reply[-1] == "1",
                               epoch=int(reply[3]), cursor=int(reply[4]), returned=reply[6:6 + num_returned],
                               leased=reply[leased_at:leased_at + num_leased],
                               pending=reply[leased_at + num_leased:-1], rollout_id=rollout_id)

    @_redis_errors
    async def restore_state(self, job_id: str, state: DataSourceState) -> tuple[int, int]:
        """Put the job's data source back to `state` (its dataset must be loaded, the same one).

        Leases end; the cursor goes back; pending, leased and returned slots whose groups are not stored are
        queued again, in that order. Returns (num_requeued, num_leases_dropped).
        """
        for slot in (*state.pending, *state.leased, *state.returned):
            if not re.fullmatch(r"\d+:\d+", slot):
                raise InvalidArgument(f"buffer: data-source state: bad slot {slot!r} (expected epoch:index)")
        bounds.integer("state.seed", state.seed, -bounds.INT64_MAX - 1, bounds.INT64_MAX)
        cursor_ok = state.cursor <= state.num_prompts if state.generated else state.cursor < state.num_prompts
        if not (0 <= state.cursor and cursor_ok) or not 0 <= state.epoch <= MAX_ROLLOUT_ID:
            raise InvalidArgument(f"buffer: data-source state: epoch {state.epoch}, cursor {state.cursor} out of "
                                  f"range for {state.num_prompts} prompts")
        reply = await self._run("restore_state", _prefix(job_id), job_id, state.num_prompts, int(state.shuffle),
                                state.seed, state.epoch, state.cursor, int(state.generated), *state.pending,
                                *state.leased, *state.returned)
        if reply[0] == -1:
            raise NotFound(f"buffer: job {job_id!r} has no dataset (call LoadDataset first)")
        if reply[0] == -2:
            num_prompts, shuffle, seed = (x.decode() for x in reply[1:])
            raise FailedPrecondition(
                f"buffer: job {job_id!r}: its dataset ({num_prompts} prompts, rollout_shuffle={shuffle == '1'}, "
                f"rollout_seed={seed}) is not the one the state was saved from ({state.num_prompts} prompts, "
                f"rollout_shuffle={state.shuffle}, rollout_seed={state.seed})")
        log.info("job %s: data source restored to epoch %d cursor %d (%d slots queued again, %d leases dropped)",
                 job_id, state.epoch, state.cursor, reply[0], reply[1])
        return int(reply[0]), int(reply[1])


def _check_payload(group: EncodedGroup) -> None:
    """InvalidArgument unless the group's bytes parse as a SampleGroup with the ids its header gives."""
    try:
        msg = sample_pb2.SampleGroup.FromString(group.payload)
    except DecodeError:
        raise InvalidArgument(f"group {group.group_id!r}: its bytes are no serialized SampleGroup") from None
    held = (msg.group_id, msg.job_id, msg.rollout_id, msg.prompt_index, msg.epoch, msg.lease_id)
    named = (group.group_id, group.job_id, group.rollout_id, group.prompt_index, group.epoch, group.lease_id)
    if held != named:
        raise InvalidArgument(f"group {group.group_id!r}: its bytes are another group's: (group_id, job_id, "
                              f"rollout_id, prompt_index, epoch, lease_id) {held} in the bytes, {named} in its header")


def _shuffled_order(num_prompts: int, seed: int) -> bytes:
    order = list(range(num_prompts))
    random.Random(seed).shuffle(order)
    return struct.pack(f"<{num_prompts}I", *order)
