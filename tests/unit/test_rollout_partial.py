"""Partial rollout bookkeeping: drained groups kept by prompt with their tokens, leases given back, resumed from the
kept tokens with the budget left, earlier-policy tokens masked, one weight version per segment."""

from __future__ import annotations

import asyncio

from services.common.samples import Prompt, Status
from services.rollout.client import RolloutState
from services.rollout.generation.partial import PartialGroups, prepare_resumed
from services.rollout.generation.prompts import PromptEncoder
from tests.unit.rollout_fakes import FakeBuffer, ScriptedRouter, new_manager, reply, rollout, rollout_config, sample_of

PROMPT = Prompt(job_id="job", index=4, epoch=1, prompt="4+1=")


def sample(response_length: int, status: Status = Status.ABORTED):
    from services.common.plugin_sample import PluginSample as RolloutSample

    return RolloutSample(prompt="4+1=", tokens=[1] * (3 + response_length), response_length=response_length,
                         loss_mask=[1] * response_length, rollout_log_probs=[-1.0] * response_length, status=status)


def test_kept_groups_are_found_by_prompt_once():
    kept = PartialGroups()
    assert not kept.keep("job", PROMPT, [sample(0), sample(0)], rollout_id=3)  # nothing generated: nothing kept
    group = [sample(2), sample(0, Status.PENDING), sample(1, Status.COMPLETED)]
    assert kept.keep("job", PROMPT, group, rollout_id=3) and len(kept) == 1
    assert [s.status for s in group] == [Status.ABORTED, Status.ABORTED, Status.COMPLETED]
    assert [s.metadata.get("start_rollout_id") for s in group] == [3, None, 3]
    other_epoch = Prompt(job_id="job", index=4, epoch=2, prompt="4+1=")
    assert kept.take("job", other_epoch, "4+1=") is None and kept.take("other", PROMPT, "4+1=") is None
    assert kept.take("job", PROMPT, "4+1=") is group and kept.take("job", PROMPT, "4+1=") is None
    kept.keep("job", PROMPT, group, rollout_id=3)
    assert kept.take("job", PROMPT, "5+1=") is None  # the same job id with another dataset: start over


def test_the_oldest_kept_groups_are_forgotten_beyond_the_limit():
    kept = PartialGroups(max_groups=2)
    prompts = [Prompt(job_id="job", index=i, epoch=0, prompt="4+1=") for i in range(3)]
    for prompt in prompts:
        kept.keep("job", prompt, [sample(1)], rollout_id=0)
    assert len(kept) == 2 and kept.take("job", prompts[0], "4+1=") is None
    assert kept.take("job", prompts[2], "4+1=") is not None


def test_offpolicy_masking_zeroes_every_earlier_token():
    group = [sample(3), sample(0)]
    prepare_resumed(group, mask_offpolicy=False)
    assert group[0].loss_mask == [1, 1, 1]
    prepare_resumed(group, mask_offpolicy=True)
    assert group[0].loss_mask == [0, 0, 0] and group[1].loss_mask == []


def test_drained_groups_resume_in_the_next_rollout(tiny_model_dir):
    """Rollout 0 wants 1 group of 2 and leases 3 prompts. Prompt 0 finishes; prompt 1's sample 0 finishes while its
    sample 1 is aborted after 2 tokens; prompt 2 is aborted before any token. Rollout 1 (new weights) resumes
    prompt 1's sample 1 from its 2 tokens and generates prompt 2 afresh."""
    encoder = PromptEncoder(tiny_model_dir)
    buffer = FakeBuffer(6)

    def first(body, headers):
        prompt, j = sample_of(body)
        return None if prompt == 2 or (prompt, j) == (1, 1) else reply([17, 18, 0], "12", weight_version="v1")

    def aborted(body):
        prompt, _ = sample_of(body)
        return reply([30, 31] if prompt == 1 else [], "ab" if prompt == 1 else "", finish="abort",
                     weight_version="v1", logprob=-2.0)

    router = ScriptedRouter(script=first, on_abort=aborted)
    manager, _ = new_manager(buffer, router, tiny_model_dir)
    cfg = rollout_config(rollout_batch_size=1, over_sampling_batch_size=3, partial_rollout=True,
                         mask_offpolicy_in_partial_rollout=True)

    async def run():
        status0 = await rollout(manager, cfg, 0)
        kept = len(manager.partial)
        num_requests = len(router.requests)
        router.script = lambda body, headers: reply([17, 18, 0], "12", finish="length", weight_version="v2")
        cfg1 = rollout_config(**{**vars(cfg), "rollout_batch_size": 2, "over_sampling_batch_size": 0})
        status1 = await rollout(manager, cfg1, 1, "v2")
        await manager.close()
        return status0, status1, kept, router.requests[num_requests:]

    status0, status1, kept, resumed_requests = asyncio.run(run())
    assert status0.state == status1.state == RolloutState.DONE
    assert [g.prompt_index for g in buffer.rollout_groups(0)] == [0] and kept == 1  # prompt 2 had nothing to keep
    assert router.num_held == 3 and len(router.aborts) == 2
    assert [g.prompt_index for g in buffer.rollout_groups(1)] == [1, 2]  # the returned prompts, served first
    assert not buffer.leased and not buffer.returned and len(manager.partial) == 0

    prompt1 = encoder.encode_text("1+1=")
    bodies = {sample_of(body): body for body, _ in resumed_requests}
    assert sorted(bodies) == [(1, 1), (2, 0), (2, 1)]  # prompt 1's finished sample is not generated again
    assert bodies[(1, 1)]["input_ids"] == prompt1 + [30, 31]  # continued from its tokens
    assert bodies[(1, 1)]["sampling_params"]["max_new_tokens"] == 5 - 2  # with the budget left
    assert bodies[(2, 0)]["input_ids"] == encoder.encode_text("2+1=") and \
        bodies[(2, 0)]["sampling_params"]["max_new_tokens"] == 5

    done, resumed = buffer.rollout_groups(1)[0].samples
    assert resumed.tokens == prompt1 + [30, 31, 17, 18, 0] and resumed.response_length == 5
    assert resumed.loss_mask == [0, 0, 1, 1, 1]  # mask_offpolicy_in_partial_rollout: the v1 tokens leave the loss
    assert resumed.rollout_log_probs == [-2.0, -3.0, -0.5, -1.5, -2.5] and resumed.response == "ab12"
    assert resumed.weight_versions == ["v1", "v2"] and resumed.status == Status.TRUNCATED
    assert resumed.metadata["start_rollout_id"] == 0 and resumed.reward == 4.0  # scored once whole
    assert done.tokens == prompt1 + [17, 18, 0] and done.loss_mask == [0, 0, 0] and done.weight_versions == ["v1"]
    assert done.status == Status.COMPLETED and done.reward == 2.0
    fresh = buffer.rollout_groups(1)[1].samples[0]
    assert fresh.loss_mask == [1, 1, 1] and fresh.weight_versions == ["v2"] and "start_rollout_id" not in fresh.metadata


def test_without_partial_rollout_drained_work_is_dropped(tiny_model_dir):
    buffer = FakeBuffer(4)
    router = ScriptedRouter(script=lambda body, headers: None if sample_of(body)[0] == 1 else reply([17], "1"),
                            on_abort=lambda body: reply([30, 31], "ab", finish="abort"))
    manager, _ = new_manager(buffer, router, tiny_model_dir)

    async def run():
        await rollout(manager, rollout_config(rollout_batch_size=1, over_sampling_batch_size=2), 0)
        router.script = lambda body, headers: reply([17], "1")
        await rollout(manager, rollout_config(rollout_batch_size=1), 1)
        await manager.close()

    asyncio.run(run())
    assert len(manager.partial) == 0 and [g.prompt_index for g in buffer.rollout_groups(1)] == [1]
    assert all(s.response_length == 1 for s in buffer.rollout_groups(1)[0].samples)  # generated afresh
