"""Generation features against the real sglang-router and real engine processes in fake-compute mode (each
decode step waits a fixed delay, so which request is still running when is known): over-sampling with abort,
partial rollout across two rollouts, session affinity under the manual policy, and eval. Buffer and reward are real
services; the manager runs in-process, as the service builds it, so the tests can look at what it keeps.
"""

from __future__ import annotations

import asyncio
import json
import shutil

import httpx
import pytest

from services.buffer.client import BufferClient
from services.common import procs
from services.common.grpc_client import wait_for_health
from services.common.samples import Status
from services.common.settings.rollout import RolloutConfig
from services.reward.client import RewardClient
from services.rollout.client import RolloutState
from services.rollout.generation.manager import RolloutManager
from services.rollout.generation.prompts import PromptEncoder
from services.rollout.local import start_router
from services.rollout.pool.router import RouterClient
from testkit.engines import engine_healthy
from tests.integration.engine_proxy import EngineProxy

FAST_DELAY_S, SLOW_DELAY_S = 0.005, 0.04  # per decode step
MAX_LEN = 20  # tokens: a fast request takes 0.1 s, a slow one 0.8 s


@pytest.fixture(scope="module")
def fake_model(tiny_model_dir, tmp_path_factory):
    """The tiny model's tokenizer and config, without an eos token: a fake-compute request always runs to its
    max_new_tokens, so its duration is max_new_tokens × the engine's delay."""
    out = tmp_path_factory.mktemp("fake-model")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, out / name)
    config = json.loads((tiny_model_dir / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "eos_token_id": None, "bos_token_id": None}))
    return out


@pytest.fixture(scope="module")
def stack(redis_url, fake_model, tmp_path_factory):
    """buffer, reward, a fast and a slow engine (each behind a Proxy), and two routers over both: round_robin and
    manual. Stopped by PID at the end."""
    work = tmp_path_factory.mktemp("generation")
    started: list[procs.ManagedProcess] = []
    proxies: list[EngineProxy] = []
    try:
        ports = {name: procs.free_port() for name in ("buffer", "reward", "fast", "slow")}
        for name, args in (("buffer", ["--redis-url", redis_url]), ("reward", ["--rest-port", str(procs.free_port())])):
            argv = procs.python_module(f"services.{name}", "--host", procs.HOST, "--port", str(ports[name]), *args)
            started.append(procs.ManagedProcess(name, argv, work / f"{name}.log").start())
        engines = {}
        for name, delay_s in (("fast", FAST_DELAY_S), ("slow", SLOW_DELAY_S)):
            argv = procs.python_module("services.engine", "--host", procs.HOST, "--port", str(ports[name]),
                                       "--model-path", str(fake_model), "--fake-compute", "true",
                                       "--per-token-delay-s", str(delay_s))
            started.append(procs.ManagedProcess(f"engine-{name}", argv, work / f"engine-{name}.log").start())
            engines[name] = (started[-1], f"http://{procs.HOST}:{ports[name]}")
        routers = {}
        for policy in ("round_robin", "manual"):
            port = procs.free_port()
            started.append(start_router(port, procs.free_port(), work / f"router-{policy}.log", policy=policy))
            routers[policy] = f"http://{procs.HOST}:{port}"
        for proc, url in engines.values():
            proc.wait_ready(lambda u=url: engine_healthy(u), timeout_s=60)
        engines = {name: url for name, (_, url) in engines.items()}
        proxies = [EngineProxy(engines["fast"]), EngineProxy(engines["slow"])]
        for router_url in routers.values():
            with RouterClient(router_url) as router:
                for proxy in proxies:
                    router.add_worker(proxy.url, timeout_s=30)
        for name in ("buffer", "reward"):
            wait_for_health(f"{procs.HOST}:{ports[name]}", timeout_s=30)
        yield {"buffer_addr": f"{procs.HOST}:{ports['buffer']}", "reward_addr": f"{procs.HOST}:{ports['reward']}",
               "routers": routers, "engines": engines, "fast": proxies[0], "slow": proxies[1], "work": work,
               "model": fake_model}
    finally:
        for proxy in proxies:
            proxy.close()
        for proc in reversed(started):
            proc.stop()


@pytest.fixture(scope="module")
def buffer(stack):
    with BufferClient(stack["buffer_addr"], timeout_s=30.0) as client:
        yield client


def load(buffer: BufferClient, stack, job_id: str, num_prompts: int) -> None:
    path = stack["work"] / f"{job_id}.jsonl"
    path.write_text("".join(json.dumps({"input": f"{i}+{i % 7}=", "label": str(i + i % 7)}) + "\n"
                            for i in range(num_prompts)))
    assert buffer.load_dataset(job_id, str(path), label_key="label").num_prompts == num_prompts


def config(job_id: str, **overrides) -> RolloutConfig:
    values = dict(job_id=job_id, rollout_batch_size=2, n_samples_per_prompt=1, rollout_max_response_len=MAX_LEN,
                  rm_type="exact_match", lease_timeout_s=30.0)
    return RolloutConfig(**{**values, **overrides})


def run_manager(stack, policy: str, body):
    """Run `await body(manager)` on an in-process manager with real buffer, reward and router; a request per
    sample (its rid names the job, prompt and sample the checks look for; tests/integration/test_rollout.py runs
    the service, which sends a group's fresh samples as one batch)."""
    async def main():
        with BufferClient(stack["buffer_addr"], timeout_s=30.0) as buffer, \
                RewardClient(stack["reward_addr"], timeout_s=30.0) as reward:
            manager = RolloutManager(buffer, reward, stack["routers"][policy], model_path=str(stack["model"]),
                                     router_policy=policy, batch_groups=False)
            try:
                return await body(manager)
            finally:
                await manager.close()

    return asyncio.run(main())


async def rollout(manager: RolloutManager, cfg: RolloutConfig, rollout_id: int, timeout_s: float = 60.0):
    manager.start_rollout(cfg, rollout_id, "v")
    await asyncio.wait_for(asyncio.shield(manager.runs[(cfg.job_id, rollout_id)].task), timeout_s)
    status = manager.status(cfg.job_id, rollout_id)
    assert status.state == RolloutState.DONE, status.error
    return status


def prompt_of(rid: str) -> int:
    return int(rid.split("-")[-3])


def set_weight_version(stack, version: str) -> None:
    for url in stack["engines"].values():
        reply = httpx.post(f"{url}/update_weight_version", json={"new_version": version}, timeout=10)
        assert reply.status_code == 200, reply.text


def test_oversampling_aborts_the_surplus_on_every_engine_and_gives_its_prompts_back(stack, buffer):
    """4 prompts leased for 2 groups: round robin sends 2 to the fast engine (done after 0.1-0.2 s) and 2 to the
    slow one (0.8 s): those are aborted once the batch is full, and the next rollout gets their prompts first."""
    job = "over"
    load(buffer, stack, job, 8)
    aborts_before = [len(stack["fast"].aborts), len(stack["slow"].aborts)]

    async def body(manager):
        await rollout(manager, config(job, over_sampling_batch_size=4), 0)
        stats = buffer.stats(job)
        await rollout(manager, config(job), 1)
        return stats

    stats = run_manager(stack, "round_robin", body)
    assert stats.num_leased == 0 and stats.num_returned == 2 and buffer.count_groups(job, 0) == 2
    assert [len(stack["fast"].aborts), len(stack["slow"].aborts)] == [a + 1 for a in aborts_before]
    assert stack["slow"].aborts[-1] == stack["fast"].aborts[-1] == {"abort_all": True}
    fast, slow = stack["fast"].requests_of(job), stack["slow"].requests_of(job)
    slow_in_rollout0 = {prompt_of(req["rid"]): rep for req, rep in slow if req["rid"].startswith(f"{job}-0-")}
    assert len(slow_in_rollout0) == 2 and all(rep["meta_info"]["finish_reason"]["type"] == "abort" and
                                              len(rep["output_ids"]) < MAX_LEN for rep in slow_in_rollout0.values())
    groups = buffer.get_batch(job, 0, 2, timeout_s=5) + buffer.get_batch(job, 1, 2, timeout_s=5)
    assert sorted(g.prompt_index for g in groups[2:]) == sorted(slow_in_rollout0)  # the surplus, served next
    assert len({g.prompt_index for g in groups}) == 4 and buffer.stats(job).num_returned == 0
    assert all(len(g.samples[0].rollout_log_probs) == MAX_LEN for g in groups)
    assert len([r for r in fast if r[0]["rid"].startswith(f"{job}-0-")]) == 2


def test_partial_rollout_continues_aborted_samples_with_the_next_weights(stack, buffer):
    job = "partial"
    load(buffer, stack, job, 8)
    encoder = PromptEncoder(stack["model"])
    cfg = config(job, over_sampling_batch_size=4, partial_rollout=True, mask_offpolicy_in_partial_rollout=True)
    set_weight_version(stack, "v0")

    async def body(manager):
        await rollout(manager, cfg, 0)
        kept = len(manager.partial)
        set_weight_version(stack, "v1")
        await rollout(manager, RolloutConfig(**{**vars(cfg), "over_sampling_batch_size": 0}), 1)
        return kept, len(manager.partial)

    kept, kept_after = run_manager(stack, "round_robin", body)
    records = stack["fast"].requests_of(job) + stack["slow"].requests_of(job)
    partial = {prompt_of(req["rid"]): rep for req, rep in records
               if req["rid"].startswith(f"{job}-0-") and rep["meta_info"]["finish_reason"]["type"] == "abort"}
    with_tokens = {p: rep for p, rep in partial.items() if rep["output_ids"]}
    assert len(partial) == 2 and with_tokens and kept == len(with_tokens) and kept_after == 0
    groups = {g.prompt_index: g for g in buffer.get_batch(job, 1, 2, timeout_s=5)}
    assert sorted(groups) == sorted(partial)  # the drained prompts came back first
    for prompt_index, rep in partial.items():
        (sample,) = groups[prompt_index].samples
        prompt_ids = encoder.encode_text(f"{prompt_index}+{prompt_index % 7}=")
        k = len(rep["output_ids"])
        assert sample.tokens[:len(prompt_ids)] == prompt_ids and sample.response_length == MAX_LEN
        assert sample.tokens[len(prompt_ids):len(prompt_ids) + k] == rep["output_ids"]
        assert sample.rollout_log_probs[:k] == [e[0] for e in rep["meta_info"]["output_token_logprobs"]]
        assert sample.loss_mask == [0] * k + [1] * (MAX_LEN - k) and sample.status == Status.TRUNCATED
        assert sample.weight_versions == (["v0", "v1"] if k else ["v1"])
        (resumed,) = [req for req, _ in records if req["rid"].startswith(f"{job}-1-{prompt_index}-")]
        assert resumed["input_ids"] == prompt_ids + rep["output_ids"]
        assert resumed["sampling_params"]["max_new_tokens"] == MAX_LEN - k


def test_manual_policy_keeps_every_turn_of_a_sample_on_one_engine(stack, buffer):
    job = "sticky"
    load(buffer, stack, job, 6)
    cfg = config(job, rollout_batch_size=6, n_samples_per_prompt=2,
                 custom_generate_function_path="tests.plugins.rollout_fns.model_tool_model")
    run_manager(stack, "manual", lambda manager: rollout(manager, cfg, 0))
    engines_of: dict[tuple[str, str], set[str]] = {}
    for name in ("fast", "slow"):
        for req, _ in stack[name].requests_of(job):
            engines_of.setdefault(tuple(req["rid"].split("-")[-3:-1]), set()).add(name)
    assert len(engines_of) == 12 and all(len(engines) == 1 for engines in engines_of.values())
    assert {name for engines in engines_of.values() for name in engines} == {"fast", "slow"}
    for group in buffer.get_batch(job, 0, 6, timeout_s=5):
        for sample in group.samples:
            assert sample.loss_mask == [1, 1, 0, 0, 1, 1, 0, 0, 1, 1]
            assert sample.rollout_log_probs[2:4] == sample.rollout_log_probs[6:8] == [0.0, 0.0]


def test_eval_reports_mean_reward_and_pass_at_k_with_the_eval_sampling(stack, buffer):
    data = stack["work"] / "eval.jsonl"
    data.write_text("".join(json.dumps({"input": f"{i}*2=", "label": str(2 * i)}) + "\n" for i in range(3)))
    cfg = config("evaljob", eval_prompt_data=[f"calc={data}"], n_samples_per_eval_prompt=4, eval_max_response_len=4,
                 rollout_max_response_len=8, custom_rm_path="tests.plugins.rollout_fns.response_length_is",
                 args={"expected_response_len": 4})
    metrics = run_manager(stack, "round_robin", lambda manager: manager.run_eval(cfg, 0, "v"))
    assert metrics == {"eval/calc": 1.0, "eval/calc-truncated_ratio": 1.0, "eval/calc-pass@1": 1.0,
                       "eval/calc-pass@2": 1.0, "eval/calc-pass@4": 1.0}
    stats = buffer.stats("evaljob.eval.calc")
    assert stats.num_prompts == 3 and stats.num_leased == 0 and stats.num_returned == 3
    requests = stack["fast"].requests_of("evaljob") + stack["slow"].requests_of("evaljob")
    assert len(requests) == 12 and {req["sampling_params"]["max_new_tokens"] for req, _ in requests} == {4}
