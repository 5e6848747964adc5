"""Rank 0's job hand-off to the workers: each job's spec goes out in order, STOP at the end, and ranks left behind
by a job are reported instead of being handed the next one; a collective broken by a lost rank (and only that) ends
the job as RanksLost."""

import json

import pytest

from services.common.errors import FailedPrecondition
from services.trainer.api.spec import parse_spec
from services.trainer.distributed.parallel import STOP, RankAborted, peer_lost
from services.trainer.driver.job import RanksLost
from services.trainer.ranks.worker import Dispatcher
from services.trainer.weight_sync.weight_sync import WeightSyncError

BASE = {"hf_checkpoint": "/m", "prompt_data": "/d.jsonl", "num_rollout": 1, "rollout_batch_size": 2}


class FakeWorld:
    distributed = True

    def __init__(self) -> None:
        self.sent: list[tuple[int, bytes]] = []
        self.missing: list[int] = []

    def send_job(self, seq: int, payload: bytes) -> None:
        self.sent.append((seq, payload))

    def wait_done(self, seq: int, timeout_s: float) -> list[int]:
        return self.missing


def test_jobs_go_to_the_workers_in_order_and_a_rank_left_behind_stops_later_jobs():
    world, ran = FakeWorld(), []
    dispatcher = Dispatcher(world, lambda spec, ctx: ran.append(spec.job_id))
    dispatcher(parse_spec({**BASE, "job_id": "a"}), None)
    world.missing = [1]  # job b ends on rank 0 while rank 1 still waits in one of its collectives
    dispatcher(parse_spec({**BASE, "job_id": "b"}), None)
    with pytest.raises(FailedPrecondition, match=r"trainer ranks \[1\] did not finish job b"):
        dispatcher(parse_spec({**BASE, "job_id": "c"}), None)
    assert ran == ["a", "b"]
    assert [(seq, json.loads(payload)["job_id"]) for seq, payload in world.sent] == [(0, "a"), (1, "b")]
    dispatcher.close()
    assert world.sent[-1] == (2, STOP)


# gloo's messages when rank 1 of a real two-process group was SIGKILLed, and when it stopped answering for longer
# than the group's timeout (torch 2.13, captured on rank 0)
GLOO_CLOSED = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
               "[127.0.0.1]:12462. This is typically caused by a remote worker crashing.")
GLOO_TIMEOUT = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting "
                "4000ms for send operation to complete")


def chained(err: BaseException, cause: BaseException) -> BaseException:
    err.__cause__ = cause
    return err


@pytest.mark.parametrize("err", [
    RuntimeError(GLOO_CLOSED), RuntimeError(GLOO_TIMEOUT), RuntimeError("Application timeout caused pair closure"),
    "DistBackendError", "DistNetworkError", chained(ValueError("all_gather failed"), RuntimeError(GLOO_CLOSED)),
    "CheckpointException"])
def test_a_broken_collective_is_a_lost_peer(err):
    import torch.distributed as dist
    from torch.distributed.checkpoint.api import CheckpointException

    if err == "CheckpointException":  # DCP's save on rank 0: one rank's failure, (exception, traceback)
        err = CheckpointException("save failed", {0: (RuntimeError(GLOO_CLOSED), None)})
    elif isinstance(err, str):
        err = getattr(dist, err)("NCCL communicator was aborted")
    assert peer_lost(err)


@pytest.mark.parametrize("err", [
    ValueError("bad reward"), RuntimeError("CUDA out of memory"), RuntimeError("Connection closed by peer"),
    RuntimeError("mat1 and mat2 shapes cannot be multiplied"), KeyError("gloo"), RankAborted("rank 0 ended the job"),
    chained(WeightSyncError("engine http://e:1 failed"), RuntimeError(GLOO_CLOSED)), "CheckpointException"])
def test_an_error_of_the_job_itself_is_not_a_lost_peer(err):
    from torch.distributed.checkpoint.api import CheckpointException

    if err == "CheckpointException":  # a truncated shard is the job's own failure
        err = CheckpointException("load failed", {0: (EOFError("truncated"), None)})
    assert not peer_lost(err)


def test_a_lost_rank_ends_the_job_as_ranks_lost_without_waiting_for_the_dead_rank():
    world = FakeWorld()
    waits = []
    world.wait_done = lambda seq, timeout_s: waits.append(seq) or []

    def runner(spec, ctx):
        if spec.job_id == "lost":
            raise RuntimeError(GLOO_CLOSED)
        raise ValueError("a bug in the job")

    dispatcher = Dispatcher(world, runner)
    with pytest.raises(ValueError):  # an ordinary failure stays itself; the workers' finishing is awaited
        dispatcher(parse_spec({**BASE, "job_id": "buggy"}), None)
    assert waits == [0] and dispatcher.broken == ""
    with pytest.raises(RanksLost, match="Connection closed by peer") as raised:
        dispatcher(parse_spec({**BASE, "job_id": "lost"}), None)
    assert isinstance(raised.value.__cause__, RuntimeError)
    assert waits == [0]  # the dead rank is not waited for
    assert "broke during job lost" in dispatcher.broken  # health reports it; later jobs are refused
    with pytest.raises(FailedPrecondition):
        dispatcher(parse_spec({**BASE, "job_id": "next"}), None)


def test_the_ranks_are_in_step_between_jobs_only_and_never_once_out_of_step():
    """rank 0 closes the world with its workers (a barrier) only when they are in step: not while a job runs, not
    after a rank was left behind."""
    world, seen = FakeWorld(), []
    dispatcher = Dispatcher(world, lambda spec, ctx: seen.append(dispatcher.in_step))
    assert dispatcher.in_step
    dispatcher(parse_spec({**BASE, "job_id": "a"}), None)
    assert seen == [False] and dispatcher.in_step
    world.missing = [1]
    dispatcher(parse_spec({**BASE, "job_id": "b"}), None)
    assert not dispatcher.in_step
