"""Rank 0's job hand-off to the workers: each job's spec goes out in order, STOP at the end, and ranks left behind
by a job are reported instead of being handed the next one."""

import json

import pytest

from services.common.errors import FailedPrecondition
from services.trainer.api.spec import parse_spec
from services.trainer.api.worker import Dispatcher
from services.trainer.distributed.parallel import STOP

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
