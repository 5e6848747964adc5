"""The trainer's ranks as one static torch.distributed world, formed at start-up from torchrun's variables.

Rank 0 runs the job API and alone talks to the rollout manager; ranks 1..N-1 (`python -m services.trainer.ranks.worker`)
take each job from the world's store, run the same driver and read their own share of each rollout from the buffer.
Here: forming the world, handing jobs over, rank 0's broadcasts (control results, never samples), a rollout's split
across ranks and a model's FSDP2 sharding. Training itself is the backend's.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import logging
import pickle
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from services.common.errors import InvalidArgument, PhysarumError
from services.common.samples import Sample, SampleGroup
from services.common.shares import Share, share_positions
from services.trainer.distributed import devices

log = logging.getLogger(__name__)

T = TypeVar("T")
JOB_KEY = "physarum/job/{seq}"
DONE_KEY = "physarum/done/{seq}/{rank}"
CLOSED_KEY = "physarum/closed/{rank}"
CLOSE_WAIT_S = 60.0  # rank 0 waits this long for the others to leave before it takes the store down
STOP = b""  # the job payload that tells workers to exit
JOB_WAIT_S = 600.0  # a worker's store wait is re-armed after this; a lost rank 0 ends it at once


# What gloo raises (a plain RuntimeError) when a peer rank died, its sockets closed, or stopped answering within the
# group's timeout; nccl and the store raise torch's DistBackendError / DistNetworkError instead.
GLOO_PEER_LOST = re.compile(r"gloo/transport/.*(Connection closed by peer|Connection reset by peer|Timed out waiting "
                            r"\d+ms for (send|recv) operation)|^Application timeout caused pair closure")


def peer_lost(err: BaseException) -> bool:
    """`err` (or the error it was raised from; for torch's CheckpointException, any rank's) is a collective between
    the trainer's ranks that broke because a peer died or timed out, not an error of the job's own code. The
    project's own errors are classified already (a weight sync that lost an engine: WeightSyncError): never."""
    seen: set[int] = set()
    pending = [err]
    while pending:
        cause = pending.pop()
        if cause is None or id(cause) in seen or isinstance(cause, PhysarumError | RankAborted) or not isinstance(
                cause, BaseException):
            continue
        seen.add(id(cause))
        if isinstance(cause, dist.DistBackendError | dist.DistNetworkError):
            return True
        if isinstance(cause, RuntimeError) and GLOO_PEER_LOST.search(str(cause)):
            return True
        failures = getattr(cause, "failures", None)  # CheckpointException: rank -> exception or (exception, tb)
        if isinstance(failures, dict):
            pending += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        pending.append(cause.__cause__)
    return False


class RankAborted(RuntimeError):
    """Raised on ranks > 0 when rank 0's part of a job failed: the job ends on every rank."""


class _NoSamples(pickle.Pickler):
    """Pickles to nowhere, refusing samples: each rank reads its own share of a rollout from the buffer, and a
    rollout handed out by rank 0 would cost it the decoding and pickling of every rank's share."""

    def reducer_override(self, obj: object) -> object:
        if isinstance(obj, Sample | SampleGroup):
            raise TypeError(f"rank 0 broadcast a {type(obj).__name__}: samples reach a rank from the buffer only")
        return NotImplemented


@dataclass
class World:
    """This process's place among the trainer's ranks; world_size 1 is the single-process trainer (no group)."""

    rank: int = 0
    world_size: int = 1
    store: dist.Store | None = None
    backend: str = "gloo"
    device: torch.device = torch.device("cpu")  # where this rank's models and batches live (devices.rank_device)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def comm_device(self) -> torch.device:
        """Where this rank's collectives run: its GPU under nccl, else the CPU (gloo)."""
        return self.device if self.backend == "nccl" else torch.device("cpu")

    def broadcast(self, obj: T) -> T:
        """Rank 0's `obj` on every rank (pickled; never a Sample: TypeError)."""
        if not self.distributed:
            return obj
        if self.rank == 0:
            _NoSamples(io.BytesIO()).dump(obj)
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, device=self.comm_device)
        return box[0]

    def on_rank0(self, fn: Callable[..., T], *args: object) -> T:
        """Run fn(*args) on rank 0 and hand its result to every rank. If it raises, rank 0 re-raises and the other
        ranks raise RankAborted, so no rank is left waiting in a collective the others never reach."""
        if self.rank != 0:
            ok, value = self.broadcast(None)
            if not ok:
                raise RankAborted(f"rank 0 ended the job: {value}")
            return value
        try:
            value = fn(*args)
        except BaseException as err:
            with contextlib.suppress(Exception):  # a dead peer must not hide the original error
                self.broadcast((False, f"{type(err).__name__}: {err}"))
            raise
        self.broadcast((True, value))
        return value

    def gather(self, obj: T) -> list[T]:
        """Every rank's `obj`, in rank order, on every rank (pickled: small objects only)."""
        if not self.distributed:
            return [obj]
        every: list[T | None] = [None] * self.world_size
        dist.all_gather_object(every, obj)
        return every

    def mean(self, metrics: dict[str, float]) -> dict[str, float]:
        """Each key's mean over the ranks that have it."""
        if not self.distributed:
            return metrics
        every = self.gather(metrics)
        keys = sorted({k for m in every if m for k in m})
        return {k: sum(m[k] for m in every if m and k in m) / sum(1 for m in every if m and k in m) for k in keys}

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def send_job(self, seq: int, payload: bytes) -> None:
        """Rank 0: hand the seq-th job (its spec as JSON, or STOP) to the workers."""
        if self.distributed:
            self.store.set(JOB_KEY.format(seq=seq), payload)

    def wait_job(self, seq: int) -> bytes:
        """Workers: block until rank 0 hands over the seq-th job; raises DistNetworkError when rank 0 is gone."""
        key = JOB_KEY.format(seq=seq)
        while True:
            try:
                self.store.wait([key], datetime.timedelta(seconds=JOB_WAIT_S))
                return self.store.get(key)
            except dist.DistStoreError as err:  # a timeout; a lost rank 0 raises DistNetworkError instead
                if "timeout" not in str(err).lower():
                    raise

    def job_done(self, seq: int) -> None:
        """Workers: tell rank 0 this rank has finished the seq-th job (however it ended)."""
        self.store.set(DONE_KEY.format(seq=seq, rank=self.rank), b"1")

    def wait_done(self, seq: int, timeout_s: float) -> list[int]:
        """Rank 0: wait up to timeout_s for every worker to finish the seq-th job; the ranks that did not."""
        missing = []
        for rank in range(1, self.world_size):
            try:
                self.store.wait([DONE_KEY.format(seq=seq, rank=rank)], datetime.timedelta(seconds=timeout_s))
            except dist.DistError:
                missing.append(rank)
        return missing

    def close(self) -> None:
        """Leave the world. First a barrier, bounded by CLOSE_WAIT_S (a dead peer ends it at once): no rank takes
        the group down while a collective it began (FSDP2's are asynchronous) still waits on a peer. A barrier that
        failed means a rank is gone or stuck: the group is left as it is, for the process's exit to end. Then the
        process groups are destroyed, and rank 0, which hosts the store, leaves last: once every other rank has
        destroyed its own. How the process then exits is `services.trainer.ranks.rank_exit`'s."""
        if not (self.distributed and dist.is_initialized()):
            return
        try:
            dist.barrier(async_op=True).wait(datetime.timedelta(seconds=CLOSE_WAIT_S))
        except RuntimeError as err:  # a timeout, a peer's error (gloo's are plain RuntimeErrors), a DistError
            # at a stop the other ranks may be gone already (a pod's SIGTERM reaches every rank)
            log.info("rank %d: the closing barrier failed (%s); leaving without the other ranks", self.rank, err)
            return
        dist.destroy_process_group()
        if self.rank != 0:
            with contextlib.suppress(dist.DistError):  # rank 0 gone: nobody waits for this rank
                self.store.set(CLOSED_KEY.format(rank=self.rank), b"1")
            return
        for rank in range(1, self.world_size):
            try:
                self.store.wait([CLOSED_KEY.format(rank=rank)], datetime.timedelta(seconds=CLOSE_WAIT_S))
            except dist.DistError:
                log.warning("rank %d did not leave the world within %.0f s; closing anyway", rank, CLOSE_WAIT_S)


def init_world(*, rank: int, world_size: int, master_addr: str, master_port: int, backend: str = "gloo",
               timeout_s: float = 1800.0, device: str = "auto") -> World:
    """Join the trainer's world (rank 0 hosts its store); blocks until every rank has joined or timeout_s. The
    rank's device (`devices.rank_device`: cuda:LOCAL_RANK when CUDA is present) is set whatever the backend."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of size {world_size}")
    rank_device = devices.rank_device(device)
    if backend == "auto":
        backend = "nccl" if rank_device.type == "cuda" else "gloo"
    if backend == "nccl" and rank_device.type != "cuda":
        raise ValueError("dist_backend nccl needs the ranks on CUDA devices (device cpu, or no CUDA visible)")
    if world_size == 1:
        return World(device=rank_device)
    timeout = datetime.timedelta(seconds=timeout_s)
    log.info("rank %d of %d: joining %s:%d (%s)", rank, world_size, master_addr, master_port, backend)
    store = dist.TCPStore(master_addr, master_port, world_size, is_master=rank == 0, timeout=timeout,
                          wait_for_workers=False)
    dist.init_process_group(backend, store=dist.PrefixStore("trainer", store), rank=rank, world_size=world_size,
                            timeout=timeout)
    log.info("rank %d of %d: the world is complete", rank, world_size)
    return World(rank=rank, world_size=world_size, store=store, backend=backend, device=rank_device)


def rollout_share(*, rank: int, world_size: int, global_batch_size: int | None,
                  n_samples_per_prompt: int) -> Share:
    """This rank's share of every rollout: each optimizer step's global_batch_size samples (groups of
    n_samples_per_prompt) dealt to the ranks in equal counts of whole groups, balanced by tokens."""
    if world_size == 1:
        return Share()
    step = global_batch_size or 0
    if step % (world_size * n_samples_per_prompt):
        raise InvalidArgument(f"with {world_size} trainer ranks, global_batch_size ({step}) must be a multiple of "
                              f"trainer ranks × n_samples_per_prompt ({world_size} × {n_samples_per_prompt}): "
                              "each rank trains an equal share of whole groups")
    return Share(index=rank, count=world_size, step_groups=step // n_samples_per_prompt)


def shard_rollout(samples: Sequence[Sample], share: Share, n_samples_per_prompt: int) -> list[Sample]:
    """`share`'s samples of a rollout held whole (a replayed dump): its groups are the runs of n_samples_per_prompt
    samples, in order, dealt as the buffer deals them (services.common.shares)."""
    groups = [samples[i:i + n_samples_per_prompt] for i in range(0, len(samples), n_samples_per_prompt)]
    ids = [f"{i:012d}" for i in range(len(groups))]  # group_id order is the rollout's order
    positions = share_positions(ids, [sum(len(s.tokens) for s in g) for g in groups], share)
    return [s for i in positions for s in groups[i]]


def shard_model(model: torch.nn.Module, world: World, *, param_dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """FSDP2 over the world: fully_shard each decoder layer, then the whole model (torchtitan's order), on a mesh of
    the ranks' own devices. Under a lower param_dtype, FSDP2's mixed precision: parameters gathered and computed in
    param_dtype, gradients reduced in float32 into float32 master shards."""
    if not world.distributed:
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if world.device.type == "cuda" and world.backend != "nccl":
        raise InvalidArgument(f"FSDP on CUDA ranks needs dist_backend nccl, not {world.backend}")
    mesh = init_device_mesh(world.device.type, (world.world_size,))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)  # the losses upcast
    layers = decoder_layers(model)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    log.info("sharded %s over %d ranks on %s (%d decoder layers, %s compute)", type(model).__name__,
             world.world_size, world.device.type, len(layers), param_dtype)
    return model


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of an HF causal LM (model.model.layers) or backbone (model.layers)."""
    for owner in (getattr(model, "model", None), model, getattr(model, "backbone", None)):
        layers = getattr(owner, "layers", None)
        if isinstance(layers, torch.nn.ModuleList):
            return list(layers)
    return []


def full_state_dict(model: torch.nn.Module, world: World) -> dict[str, torch.Tensor]:
    """The model's full (unsharded) weights on rank 0, on CPU; {} on the other ranks. Every rank must call it."""
    if not world.distributed:
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor], world: World, *,
                         strict: bool = True) -> None:
    """Every rank: copy full weights (each rank passes the whole dict) into a sharded or a plain model; strict=False
    leaves the model's tensors that `state` lacks as they are."""
    if not world.distributed:
        with torch.no_grad():
            model.load_state_dict(state, strict=strict)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, dict(state), options=StateDictOptions(full_state_dict=True, strict=strict))


def tied_names(model: torch.nn.Module) -> set[str]:
    """State-dict names whose tensor is an earlier name's (lm_head.weight under tied embeddings)."""
    seen: set[int] = set()
    tied = set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:
            tied.add(name)
        seen.add(tensor.data_ptr())
    return tied


def dp_mean(value: float, world: World) -> float:
    """`value`'s mean over the ranks. FSDP averages gradients over the ranks, so a loss normalized by the mean of
    the ranks' counts (sample or token counts of their shares of a step) is normalized by the whole step's count."""
    if not world.distributed:
        return value
    total = torch.tensor([float(value)], dtype=torch.float64, device=world.comm_device)
    dist.all_reduce(total)
    return float(total) / world.world_size
