"""A rollout manager SIGKILLed and started again while two LoRA jobs share its pool (lora_share_pool): its new engine
serves the base model alone and its pool knows no adapter, so each job's rollouts would wait for one until they fail.
Each job's trainer side (EngineWeights.announce, as its rollouts call it) syncs the adapter of its last push again from
its snapshot; both jobs' next rollouts then generate, every sample with its own job's adapter at that job's version,
its log-probs those of that job's merged model. Job a syncs by push, job b by the disk route (SGLang's)."""

from __future__ import annotations

import json
import signal
import threading
import time

import pytest
import torch

from services.buffer.client import BufferClient
from services.common import procs
from services.common.grpc_client import wait_for_health
from services.common.settings.rollout import RolloutConfig
from services.rollout.client import EngineState, RolloutClient, RolloutState
from services.trainer.distributed.parallel import World
from services.trainer.settings.weight_sync import SyncConfig
from services.trainer.weight_sync.versions import EngineWeights
from services.trainer.weight_sync.weight_sync import AdapterPush, sync_engine_pool
from tests.integration.lora_adapters import adapter_tensors, lora_state, merged_model, peft_config

RANK = 4
TIMEOUT_S = 60.0
REWARD_FN = "tests.integration.rollout_rewards.response_length_reward"
GROUPS, SAMPLES = 2, 2  # per rollout
# job -> (its lora_sync, the seeds of the adapters it pushes, one version each: 1, 2, ...)
JOBS = {"restart-a": ("push", (61, 62)), "restart-b": ("disk", (63,))}


@pytest.fixture
def services(redis_url, tmp_path):
    """The buffer and the reward service as processes, stopped by PID at the end."""
    started, addrs = [], {}
    try:
        for name in ("buffer", "reward"):
            port = procs.free_port()
            extra = ["--redis-url", redis_url] if name == "buffer" else ["--rest-port", str(procs.free_port())]
            argv = procs.python_module(f"services.{name}", "--host", procs.HOST, "--port", str(port), *extra)
            started.append(procs.ManagedProcess(name, argv, tmp_path / f"{name}.log").start())
            addrs[name] = f"{procs.HOST}:{port}"
        for addr in addrs.values():
            wait_for_health(addr, timeout_s=30)
        yield addrs
    finally:
        for proc in reversed(started):
            proc.stop()


def start_manager(services, router_url: str, model_dir, tmp_path, port: int, name: str) -> procs.ManagedProcess:
    """A manager launching one CPU engine, joining engines from the snapshots (the same work dir each time: a new one
    stops the engines its killed predecessor left)."""
    argv = procs.python_module(
        "services.rollout", "--host", procs.HOST, "--port", str(port), "--buffer-addr", services["buffer"],
        "--reward-addr", services["reward"], "--router-url", router_url, "--model-path", str(model_dir),
        "--num-engines", "1", "--engine-join-mode", "disk", "--weight-snapshot-dir", str(tmp_path / "snapshots"),
        "--engine-weight-sync-timeout-s", str(TIMEOUT_S), "--work-dir", str(tmp_path / "manager"), "--grace-s", "2")
    proc = procs.ManagedProcess(name, argv, tmp_path / f"{name}.log").start()
    try:
        wait_for_health(f"{procs.HOST}:{port}", timeout_s=180)
    except TimeoutError:
        proc.stop()
        raise AssertionError(proc.log_tail()) from None
    return proc


def rollout_config(job: str, lora_sync: str, model_dir) -> RolloutConfig:
    return RolloutConfig(job_id=job, tokenizer_path=str(model_dir), rollout_batch_size=GROUPS,
                         n_samples_per_prompt=SAMPLES, rollout_max_response_len=6, rollout_temperature=1.0,
                         custom_rm_path=REWARD_FN, lease_timeout_s=30.0,
                         args={"bonus": 1.0, "lora_rank": RANK, "lora_sync": lora_sync})


def wait_ended(client: RolloutClient, job: str, rollout_id: int, timeout_s: float = 150.0):
    """The rollout's status once it no longer runs (a rollout whose adapter never comes waits for it 300 s)."""
    deadline = time.monotonic() + timeout_s
    while (status := client.rollout_status(job, rollout_id)).state == RolloutState.RUNNING:
        assert time.monotonic() < deadline, f"rollout {rollout_id} of {job} still runs after {timeout_s} s"
        time.sleep(0.2)
    return status


@torch.no_grad()
def response_log_probs(model, tokens: list[int], response_length: int) -> list[float]:
    """The log-probs `model` gives the last `response_length` tokens (temperature 1, as the engine reports them)."""
    logits = model(input_ids=torch.tensor([tokens])).logits[0].float()
    log_probs = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
    return log_probs[-response_length:].tolist()


def test_a_restarted_manager_gets_every_sharing_jobs_adapter_and_their_rollouts_go_on(
        services, shared_router, tiny_model_dir, tmp_path):
    states = {job: [lora_state(tiny_model_dir, rank=RANK, seed=seed) for seed in seeds]
              for job, (_, seeds) in JOBS.items()}
    port = procs.free_port()
    manager = start_manager(services, shared_router.url, tiny_model_dir, tmp_path, port, "manager-1")
    client = RolloutClient(f"{procs.HOST}:{port}", timeout_s=TIMEOUT_S)
    base_pushed, sync_lock = threading.Event(), threading.Lock()
    base_pushed.set()  # the engines start from the base the jobs train on
    weights = {job: EngineWeights(World(), client, engines=True, job_id=job, lora=True, base_pushed=base_pushed,
                                  sync_lock=sync_lock, sync=SyncConfig(lora_sync=lora_sync,
                                                                       weight_sync_timeout_s=TIMEOUT_S))
               for job, (lora_sync, _) in JOBS.items()}
    try:
        for job, job_states in states.items():  # each job's pushes, as EngineWeights.push makes them
            for version, state in enumerate(job_states, start=1):
                sync_engine_pool(weights[job].adapter_broadcaster, client, adapter_tensors(state), str(version),
                                 adapter=AdapterPush(job, peft_config(RANK)))
                weights[job].version = version
        versions = {job: str(w.version) for job, w in weights.items()}
        assert client.pool_status().adapter_versions == versions

        manager.signal(signal.SIGKILL)
        manager.stop()
        manager = start_manager(services, shared_router.url, tiny_model_dir, tmp_path, port, "manager-2")
        status = client.pool_status()
        assert status.adapter_versions == {} and status.count(EngineState.SERVING) == 1  # a new engine, no adapter

        for w in weights.values():  # what each job's rollouts call before (and while) they wait for their groups
            w.announce()
        status = client.pool_status()
        assert status.adapter_versions == versions
        assert [e.state for e in status.engines] == [EngineState.SERVING]  # none demoted

        with BufferClient(services["buffer"], timeout_s=30.0) as buffer:
            for job in JOBS:
                path = tmp_path / f"{job}.jsonl"
                path.write_text("".join(json.dumps({"input": f"{i}+{i}=", "label": str(2 * i)}) + "\n"
                                        for i in range(GROUPS)))
                buffer.load_dataset(job, str(path), label_key="label")
            rollout_id = 7
            for job, (lora_sync, _) in JOBS.items():  # both at once, as the jobs' next rollouts
                client.start_rollout(rollout_config(job, lora_sync, tiny_model_dir), rollout_id, versions[job])
            for job in JOBS:
                run = wait_ended(client, job, rollout_id)
                assert run.state == RolloutState.DONE, run.error
            groups = {job: buffer.get_batch(job, rollout_id, GROUPS, timeout_s=5) for job in JOBS}
        for job, job_groups in groups.items():
            model = merged_model(tiny_model_dir, states[job][-1])  # the job's latest adapter, not an older one
            samples = [s for g in job_groups for s in g.samples]
            assert len(samples) == GROUPS * SAMPLES
            for sample in samples:
                assert sample.lora_name == job and sample.weight_versions == [versions[job]]
                assert sample.rollout_log_probs == pytest.approx(
                    response_log_probs(model, sample.tokens, sample.response_length), abs=1e-4)
    finally:
        for w in weights.values():
            w.close()
        client.close()
        manager.stop()
