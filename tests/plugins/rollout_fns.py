"""Plugins with slime's signatures for the rollout manager's tests: a multi-turn generate function with tool turns,
group reward functions, a dynamic filter and a reward."""

from __future__ import annotations

from services.rollout.engine_calls.generate import append_reply, router_generate
from services.rollout.generation.filters import DynamicFilterOutput

TOOL_TOKENS = [5, 6]  # what the "tool" answers after each model turn but the last
GROUP_CALLS: list[list[int]] = []  # the sample indices of each group_rm call


async def model_tool_model(args, sample, sampling_params):
    """Three model turns of at most 2 tokens each, TOOL_TOKENS (loss_mask 0) between them."""
    for turn in range(3):
        reply = await router_generate(sample, {"input_ids": list(sample.tokens), "return_logprob": True,
                                               "sampling_params": {**sampling_params, "max_new_tokens": 2}})
        if append_reply(sample, reply) == "abort":
            return sample
        if turn < 2:
            sample.append_response_tokens(args, tokens=TOOL_TOKENS, trainable=False, text="<tool>")
    return sample


async def generate_with_evaluation(args, sample, sampling_params, evaluation=False):
    """The default generation, tagging the sample with the `evaluation` flag it was called with."""
    from services.rollout.engine_calls.generate import generate

    sample.metadata["evaluation"] = evaluation
    return await generate(args, sample, sampling_params)


async def index_rewards(args, samples) -> list[float]:
    """group_rm: reward = sample index / 10 (+ args.bonus); records each call."""
    GROUP_CALLS.append([s.index for s in samples])
    return [s.index / 10 + getattr(args, "bonus", 0.0) for s in samples]


async def failing_group_reward(args, samples) -> list[float]:
    raise RuntimeError("the judge is down")


async def short_group_reward(args, samples) -> list[float]:
    return [1.0]


def keep_even_prompts(args, samples, **kwargs):
    """A dynamic filter returning a plain bool."""
    return samples[0].group_index % 2 == 0


def drop_odd_prompts_with_reason(args, samples, **kwargs) -> DynamicFilterOutput:
    keep = samples[0].group_index % 2 == 0
    return DynamicFilterOutput(keep=keep, reason=None if keep else "odd_prompt")


async def response_length_is(args, sample) -> float:
    """1.0 when the response has args.expected_response_len tokens (eval's max length was used), else 0."""
    return float(sample.response_length == args.expected_response_len)


async def reward_in_generate(args, sample, sampling_params):
    """The default generation; even samples get their reward here (as a multi-agent generate does in slime)."""
    from services.rollout.engine_calls.generate import generate

    sample = await generate(args, sample, sampling_params)
    if sample.index % 2 == 0:
        sample.reward = 100.0
    return sample
