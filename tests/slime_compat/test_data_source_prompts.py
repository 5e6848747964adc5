"""slime.rollout.data_source: a --data-source-path class that makes its own prompts (slime's DataSource interface,
not the buffer's dataset), in the rollout manager against a real buffer and Redis: its prompts are the groups the
trainer reads, and a restart from a checkpoint serves each prompt it yielded once, none lost, none repeated."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from services.rollout.client import RolloutState
from tests.integration.test_buffer import running_buffer_client
from tests.unit.rollout_fakes import Engine, new_manager, rollout, rollout_config

SOURCE = "tests.slime_compat.plugins.CountingPrompts"
BATCH = 2


@pytest.fixture(scope="module")
def buffer(redis_url):
    with running_buffer_client(redis_url) as client:
        yield client


def config(tmp_path, job_id, **args):
    values = {"rollout_temperature": 1.0, "rollout_top_p": 1.0, "rollout_top_k": -1,
              "rollout_max_response_len": 5, "rollout_batch_size": BATCH, "n_samples_per_prompt": 2,
              "save": str(tmp_path / "ckpt"), "save_interval": 2, "num_rollout": 6, "fail_at": -1, **args}
    return rollout_config(job_id=job_id, rollout_batch_size=BATCH, n_samples_per_prompt=2, rm_type="math",
                          rollout_function_path="tests.slime_compat.plugins.rollout_failing_at",
                          data_source_path=SOURCE, args=values)


def run(buffer, cfg, tiny_model_dir, rollout_ids):
    """Rollouts of one rollout service's life (a new manager: a process started again)."""
    async def main():
        manager, _ = new_manager(buffer, Engine(), tiny_model_dir)
        try:
            return [await rollout(manager, cfg, rollout_id) for rollout_id in rollout_ids]
        finally:
            await manager.close()
    return asyncio.run(main())


def trained(buffer, job_id, rollout_id):
    """(prompt index, question, the instance that made it) of the groups the trainer reads for the rollout."""
    groups = buffer.get_batch(job_id, rollout_id, BATCH, timeout_s=5)
    return sorted((g.prompt_index, g.samples[0].prompt, g.samples[0].metadata["made_by"]) for g in groups)


def test_a_data_source_that_makes_its_prompts_feeds_training_and_resumes_at_its_checkpoint(buffer, tiny_model_dir,
                                                                                          tmp_path):
    job = f"made-{uuid.uuid4().hex[:8]}"
    data = tmp_path / "prompts.jsonl"  # slime requires --prompt-data even of such a job; the trainer loads it
    data.write_text('{"input": "from the file"}\n')
    buffer.load_dataset(job, str(data))
    # A service's life: rollouts 0 and 1 (the source saved at 1, beside its position), then rollout 2 takes its
    # prompts and dies before writing them.
    statuses = run(buffer, config(tmp_path, job, fail_at=2), tiny_model_dir, [0, 1, 2])
    assert [s.state for s in statuses] == [RolloutState.DONE, RolloutState.DONE, RolloutState.FAILED]
    first = [trained(buffer, job, r) for r in (0, 1)]
    made_by = first[0][0][2]
    assert first == [[(0, "0+0=", made_by), (1, "1+1=", made_by)], [(2, "2+2=", made_by), (3, "3+3=", made_by)]]
    assert buffer.stats(job).num_prompts == 6  # prompts 4 and 5 were made and stored, never trained
    checkpoint = buffer.save_state(job, rollout_id=1)  # the trainer's checkpoint after rollout 1

    # The job resumes from that checkpoint in a new service: its data source is built again and loaded at rollout 1
    buffer.restore_state(job, checkpoint)
    statuses = run(buffer, config(tmp_path, job), tiny_model_dir, [2, 3])
    assert all(s.state == RolloutState.DONE for s in statuses), [s.error for s in statuses]
    again = [trained(buffer, job, r) for r in (2, 3)]
    # prompts 4 and 5 as the first source made them (stored once), then the new source's 6 and 7: the new source
    # yielded 4 and 5 again (it resumed at its saved position), and the buffer kept their first copies
    assert [(i, q) for i, q, _ in again[0]] == [(4, "4+4="), (5, "5+5=")] and {m for *_, m in again[0]} == {made_by}
    new_by = again[1][0][2]
    assert new_by != made_by and again[1] == [(6, "6+6=", new_by), (7, "7+7=", new_by)]
    stats = buffer.stats(job)
    assert (stats.num_prompts, stats.num_leased, stats.num_returned) == (8, 0, 0)
