"""The trainer's side of the weight broadcast to engines, in SGLang's protocol (/init_weights_update_group and
/update_weights_from_distributed).

The trainer is rank 0 of a separate torch.distributed group whose other ranks are the engines. Each bucket of
tensors is announced to every engine by HTTP (/update_weights_from_distributed) while rank 0 broadcasts the tensors
in the order of its names. Any failure raises within about timeout_s and drops the group; the next broadcast
rebuilds it with the current engines. `sync_engine_pool` runs one sync with the rollout manager's pool: it names the
engines, receives a snapshot on disk for engines that join later, and hears how the broadcast went.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from services.common.errors import Unavailable
from services.common.sglang import DEFAULT_GROUP_NAME, SGLangClient
from services.rollout.client import ADAPTERS_DIR, SNAPSHOT_PREFIX, adapter_snapshot_root, snapshot_path
from services.trainer.checkpoint import safetensors_io
from services.trainer.checkpoint.hf_files import copy_side_files
from services.trainer.weight_sync import rendezvous, wire

log = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")
RESUME_TIMEOUT_S = 2.0  # for the best-effort end/continue calls after a failure


class WeightSyncError(Unavailable):
    """A weight broadcast or group set-up failed; the group is dropped and rebuilt by the next broadcast."""

    def __init__(self, message: str, failed_urls: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.failed_urls = failed_urls


def init_custom_process_group(store: dist.Store, *, backend: str, world_size: int, rank: int, group_name: str,
                              timeout: datetime.timedelta) -> dist.ProcessGroup:
    """SGLang's init_custom_process_group on an existing store: PrefixStore(group_name) + _new_process_group_helper."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
                                         group_name=group_name, backend_options=None, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def buckets(named_tensors: Iterable[tuple[str, torch.Tensor]],
            bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of tensors of at most bucket_bytes each (a larger tensor gets a bucket of its own)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        num_bytes = tensor.numel() * tensor.element_size()
        if bucket and size + num_bytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += num_bytes
    if bucket:
        yield bucket


def _on_all(clients: list[SGLangClient], what: str, fn: Callable[[SGLangClient], object], wait_s: float,
            ignore_errors: bool = False) -> list:
    """fn(client) on every engine at once; raises WeightSyncError naming each engine that failed or hung."""
    if not clients:
        return []
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(clients), thread_name_prefix="weight-sync")
    try:
        futures = {pool.submit(fn, c): c for c in clients}
        return _results(futures, what, wait_s, ignore_errors)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def _results(futures: dict[concurrent.futures.Future, SGLangClient], what: str, wait_s: float,
             ignore_errors: bool = False) -> list:
    done, pending = concurrent.futures.wait(futures, timeout=wait_s)
    failed = [f for f in futures if f in pending or f.exception() is not None]
    if failed and not ignore_errors:
        errors = [f"{futures[f].url}: " + (f"no reply in {wait_s:.1f} s" if f in pending else str(f.exception()))
                  for f in failed]
        raise WeightSyncError(f"{what} failed on {len(errors)} of {len(futures)} engines: {'; '.join(errors)}",
                              tuple(futures[f].url for f in failed))
    return [f.result() if f in done and f.exception() is None else None for f in futures]


def _alongside(clients: list[SGLangClient], what: str, call: Callable[[int, SGLangClient], object],
               local: Callable[[], object], wait_s: float, on_stuck: Callable[[], None] = lambda: None) -> None:
    """call(i, client) on every engine while local() runs here: the collective they all take part in. Everything
    ends within wait_s: an engine failing or missing the deadline, or local() still blocked at it (an NCCL
    collective whose peer is gone blocks the host), runs on_stuck (abort the communicator, which frees local())
    and raises WeightSyncError naming the engines that failed."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(clients) + 1, thread_name_prefix="weight-sync")
    try:
        futures = {pool.submit(call, i, c): c for i, c in enumerate(clients)}
        mine = pool.submit(local)
        done, pending = concurrent.futures.wait([mine, *futures], timeout=wait_s,
                                                return_when=concurrent.futures.FIRST_EXCEPTION)
        if not pending and all(f.exception() is None for f in done):
            return
        if mine in pending or any(f.exception() is not None for f in futures if f in done):
            on_stuck()
        failed = [f for f in futures if f in pending or f.exception() is not None]
        replies = "".join(f"; {futures[f].url}: " + (f"no reply in {wait_s:.1f} s" if f in pending
                                                      else str(f.exception())) for f in failed)
        here = (f"the local side is still blocked after {wait_s:.1f} s" if mine in pending else
                f"{type(mine.exception()).__name__}: {mine.exception()}" if mine.exception() else "engines failed")
        raise WeightSyncError(f"{what}: {here}{replies}", tuple(futures[f].url for f in failed))
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


class WeightBroadcaster:
    """Rank 0 of the weight-update group of a set of engines (SGLang servers or Physarum CPU engines)."""

    def __init__(self, engine_urls: list[str], *, master_address: str = "127.0.0.1", master_port: int = 0,
                 group_name: str = DEFAULT_GROUP_NAME, backend: str = "gloo", timeout_s: float = 60.0,
                 bucket_bytes: int = 512 << 20, pause_mode: str = "in_place",  # SyncConfig's default
                 model_dir: str | Path | None = None, job_id: str = "") -> None:
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode must be one of {', '.join(PAUSE_MODES)}, got {pause_mode!r}")
        if timeout_s <= 0 or bucket_bytes <= 0:
            raise ValueError(f"timeout_s and bucket_bytes must be > 0, got {timeout_s} and {bucket_bytes}")
        self.engine_urls = list(engine_urls)
        self.master_address = master_address
        self.master_port = master_port
        self.group_name = group_name
        self.requested_backend = backend  # gloo, nccl, or auto (nccl for remote GPU engines, sync_wire.auto_backend)
        self.backend = "gloo" if backend == "auto" else backend  # this group's, resolved at init_group
        self.timeout_s = timeout_s
        self.bucket_bytes = bucket_bytes
        self.pause_mode = pause_mode
        self.model_dir = model_dir  # the base checkpoint: the dtype of engines that serve "auto"
        self.job_id = job_id  # names what it leaves on the host (shared-memory snapshots)
        self.dtype: torch.dtype | None = None  # what the engines serve, asked at init_group; None: as they are
        self.group: dist.ProcessGroup | None = None
        self.store: dist.TCPStore | None = None
        self.clients: list[SGLangClient] = []

    def set_engines(self, urls: list[str]) -> None:
        """Broadcast to `urls` from now on; a changed set rebuilds the group at the next broadcast."""
        if list(urls) != self.engine_urls:
            log.info("weight sync engines changed: %s -> %s", self.engine_urls, list(urls))
            self.engine_urls = list(urls)
            self._drop_group()

    def init_group(self) -> None:
        """Create the group: host the TCPStore, join as rank 0 while every engine joins as rank 1 + i."""
        self._drop_group()
        if self.backend == "nccl":  # as upstream SGLang's test does on the trainer
            os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        clients = [SGLangClient(url, timeout_s=self.timeout_s) for url in self.engine_urls]
        # NCCL's watchdog would end this process at its timeout: ours (timeout_s) aborts the group well before.
        world_size = 1 + len(clients)
        timeout = datetime.timedelta(seconds=self.timeout_s * (wire.NCCL_TIMEOUT_FACTOR if self.backend == "nccl"
                                                               else 1))
        start = time.monotonic()
        groups: list[dist.ProcessGroup] = []
        try:
            _on_all(clients, "health check", self._check_health, self.timeout_s + 1)
            infos = [info or {} for info in _on_all(clients, "get_server_info", lambda c: c.server_info(),
                                                    self.timeout_s + 1, ignore_errors=True)]
            self.dtype = wire.common_dtype(infos, self.model_dir)
            if self.requested_backend == "auto":
                self.backend = wire.auto_backend(infos, self.engine_urls)
            # An engine may still hold a group from an earlier trainer or a failed sync: drop it (best effort).
            _on_all(clients, "destroy_weights_update_group",
                    lambda c: c.destroy_weights_update_group(self.group_name), self.timeout_s + 1, ignore_errors=True)
            store = rendezvous.host_store(self.master_address, self.master_port, world_size, timeout)
            _alongside(clients, f"init_weights_update_group at {self.master_address}:{store.port}",
                       lambda i, c: c.init_weights_update_group(self.master_address, store.port, 1 + i, world_size,
                                                                self.group_name, self.backend, self.timeout_s),
                       lambda: groups.append(init_custom_process_group(
                           store, backend=self.backend, world_size=world_size, rank=0, group_name=self.group_name,
                           timeout=timeout)),
                       self.timeout_s + 1, on_stuck=lambda: [wire.abort(g) for g in groups if self.backend == "nccl"])
        except BaseException as err:
            for group in groups:
                dist.destroy_process_group(group)
            for client in clients:
                client.close()
            if isinstance(err, Exception) and not isinstance(err, WeightSyncError):
                raise WeightSyncError(f"weight update group {self.group_name!r}: {type(err).__name__}: {err}") from err
            raise
        self.group, self.store, self.clients = groups[0], store, clients
        log.info("weight update group %r: %d engines joined at %s:%d in %.2f s", self.group_name, len(clients),
                 self.master_address, store.port, time.monotonic() - start)

    def _check_health(self, client: SGLangClient) -> None:
        if not client.health(timeout_s=self.timeout_s):
            raise WeightSyncError(f"engine {client.url}: /health did not answer 200")

    def _ready(self) -> bool:
        """Whether the engines are set up for a broadcast (the group is joined)."""
        return self.group is not None

    def _begin_broadcast(self, weight_version: str, *, num_buckets: int) -> dict:
        """A broadcast's zeroed stats; sets the engines up first where not `_ready` (warns if there are none)."""
        stats = {"seconds": 0.0, "pause_seconds": 0.0, "bytes": 0, "num_tensors": 0, "num_buckets": num_buckets,
                 "num_engines": len(self.engine_urls)}
        if not self.engine_urls:
            log.warning("weight broadcast of version %s: no engines", weight_version)
        elif not self._ready():
            self.init_group()
        return stats

    def broadcast(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: str) -> dict:
        """Pause, push every tensor (HF names, in buckets), set `weight_version`, continue. Returns stats."""
        start = time.monotonic()
        stats = self._begin_broadcast(weight_version, num_buckets=0)
        if not self.engine_urls:
            return stats
        wait_s = self.timeout_s + 1
        try:  # the engines stop only from pause_generation to continue_generation: the transfer itself
            paused_at = time.monotonic()
            # each engine's calls in the protocol's order, without a barrier across engines between them
            _on_all(self.clients, "pause_generation, begin_weight_update",
                    lambda c: (c.pause_generation(self.pause_mode), c.begin_weight_update()), wait_s)
            for bucket in buckets(named_tensors, self.bucket_bytes):
                self._push_bucket(bucket, weight_version)
                stats["num_buckets"] += 1
                stats["num_tensors"] += len(bucket)
                stats["bytes"] += sum(t.numel() * t.element_size() for _, t in bucket)
            _on_all(self.clients, "end_weight_update, continue_generation",
                    lambda c: (c.end_weight_update(), c.continue_generation()), wait_s)
            stats["pause_seconds"] = time.monotonic() - paused_at
        except Exception as err:
            raise self._failed(err, f"weight broadcast of version {weight_version}", start) from err
        stats["seconds"] = time.monotonic() - start
        log.info("weights version %s: %d tensors, %.1f MB in %d buckets to %d engines in %.2f s", weight_version,
                 stats["num_tensors"], stats["bytes"] / 1e6, stats["num_buckets"], len(self.clients), stats["seconds"])
        return stats

    def adapter_for(self, adapter: AdapterPush, weight_version: str) -> AdapterPush:
        """The adapter as the engines serve it at `weight_version`: pushed under the job's own name."""
        return adapter

    def broadcast_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: str, *,
                          lora_name: str, config: dict, directory: str = "") -> dict:
        """A LoRA job's sync: pause, push the adapter's tensors (PEFT names) in one call per engine
        (/load_lora_adapter_from_distributed, which swaps the adapter whole), continue. Returns stats as
        `broadcast` does. `directory` (the adapter's snapshot, for the disk route) is not read."""
        start = time.monotonic()
        named = list(named_tensors)
        stats = self._begin_broadcast(weight_version, num_buckets=1)
        if not self.engine_urls:
            return stats
        wait_s = self.timeout_s + 1
        # in the dtype the engines serve (they would cast to it): a bf16 pool gets half the bytes
        tensors = wire.on_the_wire([t for _, t in named], backend=self.backend, dtype=self.dtype)
        names = [name for name, _ in named]
        dtypes = [str(t.dtype).removeprefix("torch.") for t in tensors]
        shapes = [list(t.shape) for t in tensors]

        def send() -> None:
            works = [dist.broadcast(t, src=0, group=self.group, async_op=True) for t in tensors]
            wire.wait_all(works, tensors)

        try:
            paused_at = time.monotonic()
            _on_all(self.clients, "pause_generation", lambda c: c.pause_generation(self.pause_mode), wait_s)
            _alongside(self.clients, f"load_lora_adapter_from_distributed of {lora_name} ({len(names)} tensors)",
                       lambda i, c: c.load_lora_adapter_from_distributed(lora_name, config, names, dtypes, shapes,
                                                                         weight_version, self.group_name,
                                                                         self.timeout_s),
                       send, wait_s, on_stuck=self._abort_group)
            _on_all(self.clients, "continue_generation", lambda c: c.continue_generation(), wait_s)
            stats["pause_seconds"] = time.monotonic() - paused_at
        except Exception as err:
            raise self._failed(err, f"adapter push of {lora_name} version {weight_version}", start) from err
        stats.update(seconds=time.monotonic() - start, num_tensors=len(names),
                     bytes=sum(t.numel() * t.element_size() for t in tensors))
        log.info("adapter %s version %s: %d tensors, %.2f MB to %d engines in %.2f s", lora_name, weight_version,
                 len(names), stats["bytes"] / 1e6, len(self.clients), stats["seconds"])
        return stats

    def _push_bucket(self, bucket: list[tuple[str, torch.Tensor]], weight_version: str) -> None:
        tensors = wire.on_the_wire([t for _, t in bucket], backend=self.backend, dtype=self.dtype)
        names = [name for name, _ in bucket]
        dtypes = [str(t.dtype).removeprefix("torch.") for t in tensors]
        shapes = [list(t.shape) for t in tensors]

        def send() -> None:
            works = [dist.broadcast(t, src=0, group=self.group, async_op=True) for t in tensors]  # in `names` order
            wire.wait_all(works, tensors)

        _alongside(self.clients, f"update_weights_from_distributed of {len(names)} tensors ({names[0]}, ...)",
                   lambda i, c: c.update_weights_from_distributed(names, dtypes, shapes, weight_version,
                                                                  self.group_name, True, self.timeout_s),
                   send, self.timeout_s + 1, on_stuck=self._abort_group)

    def _failed(self, err: Exception, what: str, start: float) -> WeightSyncError:
        """After a failed broadcast (`_recover`): the error to raise, naming the engines that failed."""
        failed = self._recover(err)
        return WeightSyncError(f"{what} to {self.engine_urls} failed after {time.monotonic() - start:.1f} s (the group "
                               f"is rebuilt next time): {err}", failed)

    def _recover(self, err: Exception) -> tuple[str, ...]:
        """After a failed broadcast: resume the engines (waiting only on those that answered), drop the group.
        Returns the URLs of the engines that failed."""
        failed = getattr(err, "failed_urls", ())
        self._resume_engines(failed)
        self._drop_group()
        return failed

    def _resume_engines(self, failed: tuple[str, ...]) -> None:
        """After a failure, end the update session and continue generation on every engine (best effort).

        Waits (briefly) only for the engines that did not fail; a hung one is still told in the background.
        """

        def resume(url: str) -> None:
            with SGLangClient(url, timeout_s=RESUME_TIMEOUT_S) as client:
                with contextlib.suppress(Exception):
                    client.end_weight_update()
                client.continue_generation()

        if not self.clients:
            return
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(self.clients), thread_name_prefix="weight-sync")
        futures = {c.url: pool.submit(resume, c.url) for c in self.clients}
        pool.shutdown(wait=False)
        concurrent.futures.wait([f for url, f in futures.items() if url not in failed], timeout=RESUME_TIMEOUT_S + 0.5)

    def _abort_group(self) -> None:
        """Abort the communicator under a blocked collective (NCCL; gloo's own timeout frees it)."""
        if self.group is not None and self.backend == "nccl":
            wire.abort(self.group)

    def _drop_group(self) -> None:
        if self.group is not None:
            try:
                dist.destroy_process_group(self.group)
            except Exception as err:  # a broken group must not block the rebuild
                log.warning("destroying weight update group %r: %s", self.group_name, err)
            # the last reference goes on a thread of its own: gloo's teardown closes the connection to every peer
            # (0.65 s at 64 engines, without the GIL), which need not hold up the rebuild
            last, self.group = [self.group], None
            threading.Thread(target=last.clear, name="weight-sync-drop", daemon=True).start()
        self.store = None
        for client in self.clients:
            client.close()
        self.clients = []

    def close(self) -> None:
        """Destroy the group on the engines (best effort) and here."""
        if self.group is not None:
            _on_all(self.clients, "destroy_weights_update_group",
                    lambda c: c.destroy_weights_update_group(self.group_name), RESUME_TIMEOUT_S + 0.5,
                    ignore_errors=True)
        self._drop_group()

    def __enter__(self) -> WeightBroadcaster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_snapshot(named_tensors: Iterable[tuple[str, torch.Tensor]], root: str | Path, version: str, *,
                   base_model_dir: str | Path | None = None, keep: int = 2) -> str:
    """Save the weights under HF names as `root/weight_v<version>/model.safetensors` (plus the base model's config and
    tokenizer files, so SGLang's /update_weights_from_disk can read it); written aside, then renamed into place.
    Older snapshots beyond the newest `keep` are deleted. Returns the snapshot's directory."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = snapshot_path(root, version)
    staging = root / f".staging-{final.name}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in named_tensors}  # each name once
    safetensors_io.write(staging / "model.safetensors", tensors.items(),
                         metadata={"format": "pt", "weight_version": str(version)})
    if base_model_dir:
        copy_side_files(base_model_dir, staging)
    return _publish(staging, final, keep)


def _publish(staging: Path, final: Path, keep: int) -> str:
    """Rename a snapshot written aside into place, then delete all but the newest `keep` snapshots beside it."""
    shutil.rmtree(final, ignore_errors=True)
    staging.rename(final)
    root = final.parent
    snapshots = sorted((p for p in root.glob(f"{SNAPSHOT_PREFIX}*") if p.is_dir()), key=lambda p: p.stat().st_mtime)
    for old in snapshots[:-keep] if keep > 0 else ():
        shutil.rmtree(old, ignore_errors=True)
    return str(final)


@dataclass(frozen=True)
class AdapterPush:
    """A LoRA job's sync: its adapter's name on the engines and PEFT's adapter config."""

    lora_name: str
    config: dict


def write_adapter_snapshot(named_tensors: Iterable[tuple[str, torch.Tensor]], root: str | Path, version: str,
                           adapter: AdapterPush, *, keep: int = 2) -> str:
    """A LoRA job's snapshot: `<adapter_snapshot_root>/weight_v<version>/adapters/<lora_name>/` (PEFT's adapter
    directory), which an engine joining later loads (/load_lora_adapter); written aside, then renamed into place;
    the job's snapshots beyond its newest `keep` deleted. Each job has a root of its own, so that jobs sharing a pool
    (and syncing the same version) neither replace nor prune each other's. Returns the snapshot's directory."""
    from services.trainer.lora.export import write_peft_dir

    root = adapter_snapshot_root(root, adapter.lora_name)
    root.mkdir(parents=True, exist_ok=True)
    final = snapshot_path(root, version)
    staging = root / f".staging-{final.name}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    write_peft_dir(staging / ADAPTERS_DIR / adapter.lora_name, dict(named_tensors), adapter.config)
    return _publish(staging, final, keep)


def sync_engine_pool(broadcaster: WeightBroadcaster, rollout, named_tensors: Sequence[tuple[str, torch.Tensor]],
                     version: str, *, base_model_dir: str | Path | None = None, max_attempts: int = 3,
                     adapter: AdapterPush | None = None) -> dict:
    """One weight sync through the rollout manager's pool (`rollout` is a RolloutClient).

    BeginWeightSync names the engines to broadcast to (serving ones, and new ones waiting for weights) and where to
    write a snapshot; the snapshot is written, the weights broadcast, and EndWeightSync reports the outcome. When an
    engine dies or hangs mid-broadcast the broadcast fails within the broadcaster's timeout; the pool checks the
    engines it names (replacing dead ones) and the sync is tried again with the engines the pool names then.
    With `adapter` (a LoRA job) the tensors are the adapter's alone: snapshotted as PEFT's adapter directory under the
    name the engines serve it by (`adapter_for`), then sent by `broadcast_adapter` (which may load that directory).
    """
    last_error: Exception | None = None
    lora_name = adapter.lora_name if adapter is not None else ""
    for attempt in range(1, max_attempts + 1):
        plan = rollout.begin_weight_sync(version, lora_name=lora_name)
        snapshot, start = "", time.monotonic()
        try:
            broadcaster.set_engines(plan.engine_urls)
            served = broadcaster.adapter_for(adapter, version) if adapter is not None else None
            if plan.snapshot_dir and served is not None:
                snapshot = write_adapter_snapshot(named_tensors, plan.snapshot_dir, version, served)
            elif plan.snapshot_dir:  # a pull transport's store serves joiners itself: snapshot + deltas, no copy
                snapshot = getattr(broadcaster, "pull_source", "") or write_snapshot(
                    named_tensors, plan.snapshot_dir, version, base_model_dir=base_model_dir)
            snapshot_s = time.monotonic() - start
            stats = broadcaster.broadcast_adapter(
                named_tensors, version, lora_name=served.lora_name, config=served.config,
                directory=str(Path(snapshot, ADAPTERS_DIR, served.lora_name)) if snapshot else "") \
                if served is not None else broadcaster.broadcast(named_tensors, version)
        except WeightSyncError as err:
            rollout.end_weight_sync(version, success=False, engine_urls=plan.engine_urls,
                                    failed_urls=list(err.failed_urls), snapshot_path=snapshot, error=str(err),
                                    lora_name=lora_name)
            last_error = err
            log.warning("weight sync of version %s, attempt %d/%d failed: %s", version, attempt, max_attempts, err)
            continue
        except BaseException as err:
            with contextlib.suppress(Exception):
                rollout.end_weight_sync(version, success=False, engine_urls=plan.engine_urls, snapshot_path=snapshot,
                                        error=f"{type(err).__name__}: {err}", lora_name=lora_name)
            raise
        rollout.end_weight_sync(version, success=True, engine_urls=plan.engine_urls, snapshot_path=snapshot,
                                seconds=time.monotonic() - start, num_bytes=int(stats["bytes"]), lora_name=lora_name)
        return {**stats, "snapshot_seconds": snapshot_s, "attempts": attempt}
    raise WeightSyncError(f"weight sync of version {version}: {max_attempts} attempts failed; last: {last_error}",
                          getattr(last_error, "failed_urls", ())) from last_error

