"""No job wedges the queue: checkpoints torch cannot read (a truncated shard, a pickled payload) raise torch's
CheckpointException, a BaseException; the job API still ends that job FAILED with a one-line reason, releases what
it held, and runs the next job. The runner loads checkpoints with the trainer's real code (driver.checkpoint over a
DCP backend); only the training around the load is left out (the real loop runs in tests/e2e)."""

import asyncio
import os
import pickle
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from services.trainer.api.client import JobsRestClient
from services.trainer.api.config import TrainerConfig
from services.trainer.api.server import create_server
from services.trainer.checkpoint import iterations
from services.trainer.checkpoint.dcp import DCPCheckpointing
from services.trainer.distributed.parallel import World


class TinyBackend(DCPCheckpointing):
    """A policy and a reference model, checkpointed like the torch backend's."""

    def __init__(self) -> None:
        self.world = World()
        self.model, self.ref_model = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def state_dict(self, parts=None):
        state = {"model": self.model.state_dict(), "ref_model": self.ref_model.state_dict()}
        return {k: v for k, v in state.items() if parts is None or k in parts}

    def load_state_dict(self, state) -> None:
        for key, value in state.items():
            getattr(self, key).load_state_dict(value)


class Runner:
    """Holds a lock while a job runs (the job's resources): the next job must find it released."""

    def __init__(self) -> None:
        self.held = threading.Lock()
        self.ran: list[str] = []

    def __call__(self, spec, ctx) -> None:
        assert self.held.acquire(timeout=10), "the previous job did not release its resources"
        try:
            backend = TinyBackend()
            if spec.ref_load:
                iterations.load_reference(spec.ref_load, backend, backend.world)
            if spec.load:
                iterations.load_checkpoint(spec.load, backend, backend.world)
            self.ran.append(spec.job_id)
        finally:
            self.held.release()


class Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/physarum-pwned",))


def saved_checkpoint(root: Path) -> Path:
    backend = TinyBackend()
    iterations.save_checkpoint(root, 0, backend, backend.world,
                                lambda: iterations.TrainerState(rollout_id=0, job_id="saver", world_size=1))
    return iterations.iteration_dir(root, 0) / backend.checkpoint_format


@pytest.fixture
def api(tmp_path):
    runner = Runner()
    loop = asyncio.new_event_loop()
    servers = loop.run_until_complete(create_server(TrainerConfig(port=0, rest_port=0), runner))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{servers.rest.port}", runner
    finally:
        asyncio.run_coroutine_threadsafe(servers.stop(1.0), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def wait_terminal(client: JobsRestClient, job_id: str, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while (job := client.get(job_id))["state"] not in ("SUCCEEDED", "FAILED", "CANCELLED"):
        assert time.monotonic() < deadline, f"job {job_id} stuck in {job['state']}"
        time.sleep(0.05)
    return job


def spec(tmp_path: Path, job_id: str, **keys) -> dict:
    model = tmp_path / "m"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    (tmp_path / "d.jsonl").write_text('{"input": "1+1", "label": "2"}\n')
    return {"hf_checkpoint": str(model), "prompt_data": str(tmp_path / "d.jsonl"), "num_rollout": 1,
            "rollout_batch_size": 1, "job_id": job_id, **keys}


def test_a_truncated_checkpoint_fails_its_job_and_the_next_job_runs(api, tmp_path):
    url, runner = api
    state_dir = saved_checkpoint(tmp_path / "ckpt")
    for shard in state_dir.glob("*.distcp"):  # a partial copy
        shard.write_bytes(shard.read_bytes()[:32])
    with JobsRestClient(url) as client:
        client.submit(spec(tmp_path, "truncated", load=str(tmp_path / "ckpt")))
        client.submit(spec(tmp_path, "next"))
        bad = wait_terminal(client, "truncated")
        assert bad["state"] == "FAILED"
        assert bad["error"].startswith("CheckpointException: rank 0: ") and "\n" not in bad["error"]
        assert wait_terminal(client, "next")["state"] == "SUCCEEDED"
        assert client.cancel("truncated")["state"] == "FAILED"  # cancel answers the final state
    assert runner.ran == ["next"]
    assert httpx.get(f"{url}/healthz", timeout=5).json() == {"status": "ok"}


def test_a_pickled_checkpoint_fails_its_job_without_running_the_pickle_and_the_next_job_runs(api, tmp_path):
    url, runner = api
    state_dir = saved_checkpoint(tmp_path / "ckpt")
    (state_dir / ".metadata").write_bytes(pickle.dumps(Evil()))
    marker = Path("/tmp/physarum-pwned")
    marker.unlink(missing_ok=True)
    with JobsRestClient(url) as client:
        client.submit(spec(tmp_path, "pickled-ref", ref_load=str(tmp_path / "ckpt"), use_kl_loss=True))
        client.submit(spec(tmp_path, "pickled-load", load=str(tmp_path / "ckpt")))
        client.submit(spec(tmp_path, "after"))
        ref = wait_terminal(client, "pickled-ref")
        load = wait_terminal(client, "pickled-load")
        assert wait_terminal(client, "after")["state"] == "SUCCEEDED"
    assert ref["state"] == load["state"] == "FAILED"
    assert "global posix.system is not part of checkpoint metadata" in ref["error"]  # through CheckpointException
    assert "global posix.system is not part of checkpoint metadata" in load["error"]
    assert not marker.exists() and runner.ran == ["after"]
