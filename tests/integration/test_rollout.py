"""The rollout manager as a process, with real Redis, buffer and reward services, the real sglang-router and a
real CPU engine behind a recording proxy (it records every /generate reply and can hold requests back).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from services.buffer.client import BufferClient
from services.common import procs
from services.common.grpc_client import wait_for_health
from services.common.samples import Status, group_id_for
from services.common.settings.rollout import RolloutConfig
from services.common.sglang import SGLangClient
from services.rollout.client import EngineInfo, RolloutClient, RolloutState
from services.rollout.generation.prompts import PromptEncoder
from tests.integration.engine_proxy import EngineProxy

REWARD_FN = "tests.integration.rollout_rewards.response_length_reward"


def wait_until(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not true after {timeout_s} s")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def stack(redis_url, tiny_model_dir, tmp_path_factory, shared_router, cpu_engine_url):
    """buffer, reward, the session's router and engine (behind an EngineProxy); stopped by PID at the end."""
    work = tmp_path_factory.mktemp("rollout")
    started: list[procs.ManagedProcess] = []
    proxy = None
    try:
        buffer_port, reward_port = procs.free_port(), procs.free_port()
        for name, args in (("buffer", ["--port", str(buffer_port), "--redis-url", redis_url]),
                           ("reward", ["--port", str(reward_port), "--rest-port", str(procs.free_port())])):
            argv = procs.python_module(f"services.{name}", "--host", procs.HOST, *args)
            started.append(procs.ManagedProcess(name, argv, work / f"{name}.log").start())
        engine_url = cpu_engine_url
        for port in (buffer_port, reward_port):
            wait_for_health(f"{procs.HOST}:{port}", timeout_s=30)
        proxy = EngineProxy(engine_url)
        yield {"work": work, "buffer_addr": f"{procs.HOST}:{buffer_port}", "reward_addr": f"{procs.HOST}:{reward_port}",
               "router_url": shared_router.url, "engine_url": engine_url, "proxy": proxy,
               "model_dir": tiny_model_dir}
    finally:
        if proxy is not None:
            proxy.close()
        for proc in reversed(started):
            proc.stop()


def start_manager(stack, name: str) -> tuple[procs.ManagedProcess, str]:
    port = procs.free_port()
    argv = procs.python_module("services.rollout", "--host", procs.HOST, "--port", str(port), "--buffer-addr",
                               stack["buffer_addr"], "--reward-addr", stack["reward_addr"], "--router-url",
                               stack["router_url"], "--model-path", str(stack["model_dir"]), "--engine-urls",
                               stack["proxy"].url, "--work-dir", str(stack["work"] / name), "--grace-s", "2")
    proc = procs.ManagedProcess(name, argv, stack["work"] / f"{name}.log").start()
    try:
        wait_for_health(f"{procs.HOST}:{port}", timeout_s=60)
    except TimeoutError:
        proc.stop()
        raise AssertionError(proc.log_tail()) from None
    return proc, f"{procs.HOST}:{port}"


@pytest.fixture(scope="module")
def manager(stack):
    proc, addr = start_manager(stack, "manager")
    with RolloutClient(addr, timeout_s=10.0) as client:
        yield client
    proc.stop()


@pytest.fixture(scope="module")
def buffer(stack):
    with BufferClient(stack["buffer_addr"], timeout_s=30.0) as client:
        yield client


def load_addition(buffer: BufferClient, stack, job_id: str, num_prompts: int, **kwargs) -> None:
    path = stack["work"] / f"{job_id}.jsonl"
    rows = [{"input": f"{i}+{i % 7}=", "label": str(i + i % 7)} for i in range(num_prompts)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    info = buffer.load_dataset(job_id, str(path), label_key="label", **kwargs)
    assert info.num_prompts == num_prompts and info.num_skipped == 0


def rollout_config(job_id: str, **overrides) -> RolloutConfig:
    values = dict(job_id=job_id, rollout_batch_size=4, n_samples_per_prompt=3, rollout_max_response_len=8,
                  rollout_temperature=1.0, custom_rm_path=REWARD_FN, args={"bonus": 1.0}, lease_timeout_s=30.0)
    return RolloutConfig(**{**values, **overrides})


def wait_done(client: RolloutClient, job_id: str, rollout_id: int, timeout_s: float = 90.0):
    wait_until(lambda: client.rollout_status(job_id, rollout_id).state != RolloutState.RUNNING, timeout_s,
               f"rollout {rollout_id} of {job_id} finished")
    status = client.rollout_status(job_id, rollout_id)
    assert status.state == RolloutState.DONE, status.error
    return status


def test_rollout_writes_groups_exactly_as_the_engine_returned_them(stack, manager, buffer):
    job = "grpo"
    load_addition(buffer, stack, job, 8)
    assert manager.rollout_status(job, 0).state == RolloutState.UNKNOWN
    num_before = len(stack["proxy"].generated)
    assert manager.start_rollout(rollout_config(job), 0, "v0") is False
    assert manager.start_rollout(rollout_config(job), 0, "v0") is True
    status = wait_done(manager, job, 0)
    assert status.num_groups_done == 4 and status.num_groups_target == 4
    groups = buffer.get_batch(job, 0, 4, timeout_s=5)
    assert sorted(g.group_id for g in groups) == [group_id_for(job, 0, i) for i in range(4)]
    with SGLangClient(stack["engine_url"]) as engine:
        version = engine.weight_version()
    encoder = PromptEncoder(stack["model_dir"])
    samples = [s for g in groups for s in g.samples]
    assert len(samples) == 12 and all(len(g.samples) == 3 for g in groups)
    for group in groups:
        prompt_ids = encoder.encode_text(f"{group.prompt_index}+{group.prompt_index % 7}=")
        for j, sample in enumerate(group.samples):
            n = sample.response_length
            assert sample.index == j and sample.group_index == group.prompt_index and 1 <= n <= 8
            assert sample.tokens[:-n] == prompt_ids and len(sample.rollout_log_probs) == n
            assert all(lp <= 0 for lp in sample.rollout_log_probs) and sample.loss_mask == [1] * n
            assert sample.weight_versions == [version] and sample.status in (Status.COMPLETED, Status.TRUNCATED)
            assert sample.label == str(group.prompt_index + group.prompt_index % 7)
            if j < 2:
                assert sample.reward == pytest.approx(n / 100 + 1.0) and sample.reward_error == ""
            else:
                assert sample.reward == 0.0 and "sample 2 is never scored" in sample.reward_error
    recorded = sorted((req["input_ids"] + rep["output_ids"], [e[0] for e in rep["meta_info"]["output_token_logprobs"]])
                      for req, rep in stack["proxy"].since(num_before))
    assert sorted((s.tokens, s.rollout_log_probs) for s in samples) == recorded  # exactly, bit for bit
    mean_len = sum(s.response_length for s in samples) / 12
    assert status.metrics["rollout/response_len_mean"] == pytest.approx(mean_len)
    assert status.metrics["rollout/reward_mean"] == pytest.approx(sum(s.reward for s in samples) / 12)
    assert status.metrics["rollout/truncated_ratio"] == pytest.approx(
        sum(s.status == Status.TRUNCATED for s in samples) / 12)
    engines, router_url = manager.list_engines()
    assert engines == [EngineInfo(url=stack["proxy"].url, weight_version=version, healthy=True)]
    assert router_url == stack["router_url"]


def test_sft_rollout_builds_label_responses_from_chat_prompts(stack, manager, buffer):
    job = "sft"
    load_addition(buffer, stack, job, 4, apply_chat_template=True)
    num_records = len(stack["proxy"].generated)
    assert manager.start_rollout(rollout_config(job, loss_type="sft_loss", n_samples_per_prompt=1), 0, "v3") is False
    wait_done(manager, job, 0)
    encoder = PromptEncoder(stack["model_dir"])
    for group in buffer.get_batch(job, 0, 4, timeout_s=5):
        (sample,) = group.samples
        i = group.prompt_index
        text = f"<|im_start|>user\n{i}+{i % 7}=<|im_end|>\n<|im_start|>assistant\n"
        label_ids = encoder.encode_text(str(i + i % 7)) + [encoder.eos_token_id]
        assert sample.prompt == text and sample.response == str(i + i % 7)
        assert sample.tokens == encoder.encode_text(text) + label_ids and sample.response_length == len(label_ids)
        assert sample.loss_mask == [1] * len(label_ids) and sample.rollout_log_probs == [0.0] * len(label_ids)
        assert sample.reward == 0.0 and sample.status == Status.COMPLETED and sample.weight_versions == ["v3"]
    assert len(stack["proxy"].generated) == num_records  # nothing was generated


def test_manager_killed_mid_rollout_loses_no_prompt(stack, buffer):
    job, proxy = "kill", stack["proxy"]
    load_addition(buffer, stack, job, 12)
    config = rollout_config(job, lease_timeout_s=2.0)
    first, addr = start_manager(stack, "manager-killed")
    proxy.hold_after(2)  # at most 2 of the 4 groups can finish (a group's 3 samples are one /generate)
    try:
        with RolloutClient(addr) as client:
            client.start_rollout(config, 0, "v0")
            wait_until(lambda: proxy.num_held >= 1 and buffer.count_groups(job, 0) >= 1, 60,
                       "a group written and a /generate request held")
        first.signal(signal.SIGKILL)
        first.popen.wait(timeout=10)
    finally:
        proxy.release()
        first.stop(grace_s=2)  # a no-op after the SIGKILL; stops it if the test failed before
    assert 1 <= buffer.count_groups(job, 0) <= 2  # the other prompts stay leased by the dead manager
    wait_until(lambda: buffer.stats(job).num_leased == 0, 15, "the dead manager's leases expired")
    second, addr = start_manager(stack, "manager-restarted")
    try:
        with RolloutClient(addr) as client:
            assert client.rollout_status(job, 0).state == RolloutState.UNKNOWN
            assert client.start_rollout(config, 0, "v0") is False
            wait_done(client, job, 0)
            assert buffer.count_groups(job, 0) == 4
            for rollout_id in (1, 2):  # the rest of the epoch
                client.start_rollout(config, rollout_id, "v0")
                wait_done(client, job, rollout_id)
    finally:
        assert second.stop() == 0
    groups = [g for r in range(3) for g in buffer.get_batch(job, r, 4, timeout_s=5)]
    assert [buffer.count_groups(job, r) for r in range(3)] == [4, 4, 4]
    assert sorted(g.prompt_index for g in groups) == list(range(12)) and {g.epoch for g in groups} == {0}
    assert len({g.group_id for g in groups}) == 12 and all(len(g.samples) == 3 for g in groups)
    stats = buffer.stats(job)
    assert stats.num_leased == 0 and stats.num_returned == 0


def test_sigterm_cancels_rollouts_and_returns_their_leases(stack, buffer):
    job, proxy = "term", stack["proxy"]
    load_addition(buffer, stack, job, 8)
    proc, addr = start_manager(stack, "manager-terminated")
    proxy.hold_after(0)
    try:
        with RolloutClient(addr) as client:
            client.start_rollout(rollout_config(job, lease_timeout_s=600.0), 0, "v0")
            wait_until(lambda: proxy.num_held >= 1 and buffer.stats(job).num_leased == 4, 60, "4 prompts leased")
        assert proc.stop(grace_s=20) == 0
    finally:
        proxy.release()
        proc.stop(grace_s=2)
    stats = buffer.stats(job)  # returned explicitly: the 600 s leases have not expired
    assert stats.num_leased == 0 and stats.num_returned == 4 and buffer.count_groups(job, 0) == 0


def test_manager_starts_registers_and_stops_its_own_engine(stack):
    port = procs.free_port()
    argv = procs.python_module("services.rollout", "--host", procs.HOST, "--port", str(port), "--buffer-addr",
                               stack["buffer_addr"], "--reward-addr", stack["reward_addr"], "--router-url",
                               stack["router_url"], "--model-path", str(stack["model_dir"]), "--num-engines", "1",
                               "--work-dir", str(stack["work"] / "own-engine"))
    proc = procs.ManagedProcess("manager-own-engine", argv, stack["work"] / "manager-own-engine.log").start()
    try:
        wait_for_health(f"{procs.HOST}:{port}", timeout_s=120)
        with RolloutClient(f"{procs.HOST}:{port}") as client:
            (engine,), _ = client.list_engines()
        workers = httpx.get(f"{stack['router_url']}/workers", timeout=5).json()["workers"]
        assert engine.healthy and engine.url in [w["url"] for w in workers]
    finally:
        assert proc.stop(grace_s=20) == 0, proc.log_tail()
    workers = httpx.get(f"{stack['router_url']}/workers", timeout=5).json()["workers"]
    assert engine.url not in [w["url"] for w in workers]
    with SGLangClient(engine.url) as gone:
        assert not gone.health(timeout_s=1.0)  # the engine process was stopped


def test_manager_imports_no_torch():
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "services.rollout", "--help"],
                            capture_output=True, text=True, timeout=60, cwd=Path(__file__).parents[2])
    assert result.returncode == 0 and "--router-url" in result.stdout
    modules = {line.split("|")[-1].strip().split(".")[0] for line in result.stderr.splitlines() if "|" in line}
    assert "grpc" in modules and not modules & {"torch", "transformers"}
