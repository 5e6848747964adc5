"""slime's hooks through the real rollout service: a job submitted with slime's `--rollout-function-path`,
`--data-source-path` and `--buffer-filter-path` (tests/plugins/slime_rollout.py, written with slime's imports only)
runs two rollouts in the rollout service as a process, against real Redis, buffer and reward services, the real
sglang-router and a real CPU engine; the groups the trainer reads from the buffer are the function's, with the data
source's and the filter's marks, the engine's tokens and weight version, and the job's rewards.
"""

from __future__ import annotations

import json
import time

import pytest

from services.buffer.client import BufferClient
from services.common import procs
from services.common.grpc_client import wait_for_health
from services.common.samples import Status, group_id_for
from services.common.sglang import SGLangClient
from services.rollout.client import RolloutClient, RolloutState
from services.trainer.api.spec import parse_spec
from tests.plugins.slime_rollout import PRESET_REWARD

HOOKS = "tests.plugins.slime_rollout"
REWARD_FN = "tests.integration.rollout_rewards.response_length_reward"  # response_length / 100 + args.bonus


@pytest.fixture(scope="module")
def stack(redis_url, tiny_model_dir, tmp_path_factory, shared_router, cpu_engine_url):
    """buffer, reward and the rollout service as processes, over the session's router and CPU engine."""
    work = tmp_path_factory.mktemp("rollout-function")
    started: list[procs.ManagedProcess] = []
    try:
        ports = {name: procs.free_port() for name in ("buffer", "reward", "rollout")}
        for name, args in (("buffer", ["--redis-url", redis_url]), ("reward", ["--rest-port", str(procs.free_port())]),
                           ("rollout", ["--buffer-addr", f"{procs.HOST}:{ports['buffer']}", "--reward-addr",
                                        f"{procs.HOST}:{ports['reward']}", "--router-url", shared_router.url,
                                        "--model-path", str(tiny_model_dir), "--engine-urls", cpu_engine_url,
                                        "--work-dir", str(work / "rollout"), "--grace-s", "2"])):
            argv = procs.python_module(f"services.{name}", "--host", procs.HOST, "--port", str(ports[name]), *args)
            started.append(procs.ManagedProcess(name, argv, work / f"{name}.log").start())
        for name, port in ports.items():
            try:
                wait_for_health(f"{procs.HOST}:{port}", timeout_s=90)
            except TimeoutError:
                raise AssertionError(next(p for p in started if p.name == name).log_tail()) from None
        yield {"work": work, "buffer_addr": f"{procs.HOST}:{ports['buffer']}",
               "rollout_addr": f"{procs.HOST}:{ports['rollout']}", "engine_url": cpu_engine_url}
    finally:
        for proc in reversed(started):
            proc.stop()


def wait_done(client: RolloutClient, job_id: str, rollout_id: int, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while (status := client.rollout_status(job_id, rollout_id)).state == RolloutState.RUNNING:
        assert time.monotonic() < deadline, f"rollout {rollout_id} still running after {timeout_s} s"
        time.sleep(0.2)
    assert status.state == RolloutState.DONE, status.error
    return status


def test_a_users_rollout_function_data_source_and_buffer_filter_run_two_rollouts_in_the_service(stack,
                                                                                               tiny_model_dir):
    job, work = "slime-hooks", stack["work"]
    data = work / "prompts.jsonl"
    data.write_text("".join(json.dumps({"input": f"{i}+{i}=", "label": str(2 * i)}) + "\n" for i in range(6)))
    spec = parse_spec({
        "job_id": job, "hf_checkpoint": str(tiny_model_dir), "prompt_data": str(data), "num_rollout": 2,
        "rollout_batch_size": 2, "n_samples_per_prompt": 2, "rollout_max_response_len": 4, "custom_rm_path": REWARD_FN,
        "save": str(work / "ckpt"), "save_interval": 2, "plugin_args": {"bonus": 1.0},
        "slime_args": f"--rollout-function-path {HOOKS}.generate_rollout --data-source-path {HOOKS}.TaggedDataSource "
                      f"--buffer-filter-path {HOOKS}.take_newest"})
    config = spec.rollout
    assert (config.rollout_function_path, config.data_source_path, config.buffer_filter_path) == (
        f"{HOOKS}.generate_rollout", f"{HOOKS}.TaggedDataSource", f"{HOOKS}.take_newest")
    with BufferClient(stack["buffer_addr"], timeout_s=30.0) as buffer, \
            RolloutClient(stack["rollout_addr"], timeout_s=30.0) as rollout:
        assert buffer.load_dataset(job, str(data), label_key="label").num_prompts == 6
        batches = []
        for rollout_id in (0, 1):
            rollout.start_rollout(config, rollout_id, "v0")
            status = wait_done(rollout, job, rollout_id)
            assert status.num_groups_done == 2
            batches.append(buffer.get_batch(job, rollout_id, 2, timeout_s=10))  # what the trainer reads
        stats = buffer.stats(job)
    with SGLangClient(stack["engine_url"]) as engine:
        version = engine.weight_version()
    first, second = ([g.prompt_index for g in groups] for groups in batches)
    assert first == [0, 1] and second == [2, 3]  # prompt 2 was given back in rollout 0, taken by the filter in 1
    assert [g.group_id for g in batches[1]] == [group_id_for(job, 0, 2), group_id_for(job, 0, 3)]
    for rollout_id, groups in enumerate(batches):
        for position, group in enumerate(groups):
            assert len(group.samples) == 2
            for sample in group.samples:
                n = sample.response_length
                assert sample.metadata["rollout_function"] == rollout_id
                assert sample.metadata["data_source"] == "TaggedDataSource" and sample.metadata["loaded_from"] == -1
                assert sample.metadata.get("taken_by_filter") == (1 if group.prompt_index == 2 else None)
                assert 1 <= n <= 4 and len(sample.rollout_log_probs) == n and sample.loss_mask == [1] * n
                assert sample.weight_versions == [version] and sample.status in (Status.COMPLETED, Status.TRUNCATED)
                expected = PRESET_REWARD if position == 0 else n / 100 + 1.0  # the function's, else the job's
                assert sample.reward == pytest.approx(expected)
    # one prompt (4) is leased by the data source for rollout 2; none is lost, none is waiting to be served again
    assert stats.num_leased == 1 and stats.num_returned == 0 and stats.num_groups == 4
    assert json.loads((work / "ckpt" / "data_source_1.json").read_text()) == {"buffered": 1}
