"""Helpers of the durability tests: SIGKILL a process the local stack recorded, follow a job, and account
for every prompt slot of a job in the buffer's Redis once it has ended."""

from __future__ import annotations

import collections
import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from physarum import stack
from services.trainer.api.client import TERMINAL_STATES, JobsRestClient


def write_prompts(path: Path, pairs: list[tuple[int, int]]) -> Path:
    """A small addition dataset (slime's keys), so that a job of a few rollouts spans whole epochs."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"input": f"{a}+{b}=", "label": str(a + b)}) + "\n" for a, b in pairs))
    return path


def entry_of(work_dir: Path, name: str) -> dict:
    state = stack.read_state(work_dir)
    return next(e for e in state["processes"] if e["name"] == name)


def kill(work_dir: Path, name: str, timeout_s: float = 10.0) -> dict:
    """SIGKILL the process the stack recorded as `name` (PID and start time checked first); returns its entry once
    it is gone (an unreaped child counts as gone)."""
    entry = entry_of(work_dir, name)
    kill_pid(entry["pid"], entry["start_time"], name, timeout_s)
    return entry


def kill_pid(pid: int, start_time: int | None, what: str, timeout_s: float = 10.0) -> None:
    """SIGKILL `pid`, which must still be the process that started at `start_time`; wait until it is gone."""
    owned = {"pid": pid, "start_time": start_time, "argv": []}
    assert start_time is not None and stack._owned(owned), f"{what} (pid {pid}) does not run"
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while stack._owned(owned):
        assert time.monotonic() < deadline, f"{what} (pid {pid}) still runs {timeout_s} s after SIGKILL"
        time.sleep(0.05)


def wait_for(what: str, predicate, timeout_s: float, interval_s: float = 0.05):
    """Poll `predicate` until it returns something truthy (returned); AssertionError after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"not after {timeout_s} s: {what}"
        time.sleep(interval_s)
    return value


def submit(state: dict, spec: dict) -> str:
    with JobsRestClient(state["trainer_url"], timeout_s=30) as client:
        return client.submit(spec)["job_id"]


def job(state: dict, job_id: str) -> dict:
    with JobsRestClient(state["trainer_url"], timeout_s=30) as client:
        return client.get(job_id)


def wait_job(state: dict, job_id: str, timeout_s: float) -> tuple[dict, list[dict]]:
    """The job once it ended, and its events."""
    with JobsRestClient(state["trainer_url"], timeout_s=30) as client:
        final = wait_for(f"job {job_id} ends", lambda: (j := client.get(job_id))["state"] in TERMINAL_STATES and j,
                         timeout_s, interval_s=0.2)
        return final, client.events(job_id)


def trained_rollouts(events: list[dict]) -> list[int]:
    return sorted(e["rollout_id"] for e in events if "train/loss" in e["metrics"])


@dataclass
class Ledger:
    """Where each prompt slot ("epoch:index") of a job is, read from Redis after the job ended."""

    num_prompts: int
    epoch: int  # the data source's cursor: every slot before (epoch, cursor) was leased at least once
    cursor: int
    trained: dict[int, list[str]]  # rollout id -> the slots it trained on (its first rollout_batch_size groups)
    places: dict[str, list[str]] = field(default_factory=dict)  # slot -> every place it is found

    def slots_before_cursor(self) -> list[str]:
        return [f"{e}:{i}" for e in range(self.epoch + 1) for i in range(self.num_prompts)
                if e < self.epoch or i < self.cursor]

    def trained_per_epoch(self) -> dict[int, int]:
        return dict(collections.Counter(int(s.split(":")[0]) for slots in self.trained.values() for s in slots))


def _slot(group_id: bytes | str) -> str:
    text = group_id.decode() if isinstance(group_id, bytes) else group_id
    return ":".join(text.rsplit(":", 2)[-2:])


def ledger(redis_url: str, job_id: str, num_rollout: int, batch: int) -> Ledger:
    """Every place a slot can be: trained by rollout r (its list's first `batch` groups), assigned to a rollout but
    never trained (past `batch`, or a rollout id >= num_rollout), dropped (rollout -1), waiting in the fully_async
    stream (rollout -2), queued to be leased again (returned), or leased."""
    client = redis.Redis.from_url(redis_url, socket_timeout=10)
    p = f"physarum:{{{job_id}}}:"
    try:
        meta = {k.decode(): v.decode() for k, v in client.hgetall(p + "meta").items()}
        places: dict[str, list[str]] = collections.defaultdict(list)
        trained: dict[int, list[str]] = {}
        for key in client.scan_iter(match=f"{p}rollout:*"):  # braces are literal in a Redis pattern
            rollout_id = int(key.decode().rsplit(":", 1)[1])
            slots = [_slot(g) for g in client.lrange(key, 0, -1)]
            if 0 <= rollout_id < num_rollout:
                trained[rollout_id] = slots[:batch]
                for slot in slots[:batch]:
                    places[slot].append(f"trained by rollout {rollout_id}")
                for slot in slots[batch:]:
                    places[slot].append(f"assigned to rollout {rollout_id} past its batch (never trained)")
            else:
                where = {-1: "dropped", -2: "waiting in the stream"}.get(rollout_id,
                                                                         f"assigned to rollout {rollout_id}")
                for slot in slots:
                    places[slot].append(where)
        for slot in client.lrange(p + "returned", 0, -1):
            places[slot.decode()].append("returned")
        for slot in client.hvals(p + "leases"):
            places[slot.decode()].append("leased")
        return Ledger(num_prompts=int(meta["num_prompts"]), epoch=int(meta["epoch"]), cursor=int(meta["cursor"]),
                      trained=trained, places=dict(places))
    finally:
        client.close()


def check_ledger(book: Ledger, num_rollout: int, batch: int) -> None:
    """Nothing lost, nothing twice: each rollout trained a full batch; every slot is in one place at most (trained
    once, or dropped, or waiting to be trained); every slot the data source has passed is somewhere; none is
    assigned to a rollout that never trained it."""
    assert sorted(book.trained) == list(range(num_rollout)), f"rollouts with groups: {sorted(book.trained)}"
    short = {r: len(s) for r, s in book.trained.items() if len(s) != batch}
    assert not short, f"rollouts without a full batch of {batch} groups: {short}"
    twice = {slot: where for slot, where in book.places.items() if len(where) > 1}
    assert not twice, f"slots in more than one place (trained or to be trained twice): {twice}"
    untrainable = {slot: where for slot, where in book.places.items()
                   if where[0].startswith("assigned to rollout")}
    assert not untrainable, f"slots assigned where no rollout trains them (lost): {untrainable}"
    lost = [slot for slot in book.slots_before_cursor() if slot not in book.places]
    assert not lost, (f"slots the data source passed (epoch {book.epoch}, cursor {book.cursor}) that are nowhere "
                      f"(lost): {lost}")
