"""One group: the samples answering one prompt, each run through the generate function concurrently, and the
generation settings one rollout (or eval) of a job shares, and what scores a generated group. Knows nothing of the
buffer or of filters.
"""

from __future__ import annotations

import asyncio
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.common.errors import InvalidArgument
from services.common.gen.physarum.v1 import sample_pb2
from services.common.plugin_sample import PluginSample
from services.common.samples import Prompt, Sample, Status
from services.common.settings.rollout import RolloutConfig
from services.common.sglang import lora_adapter_name
from services.rollout.engine_calls.generate import (
    GenerateContext,
    generate,
    generate_fresh_batch,
    load_generate_function,
    new_session_id,
    plugin_args,
    run_generate,
    sampling_params,
    use_context,
)
from services.rollout.engine_calls.router_http import Poster
from services.rollout.generation import teacher
from services.rollout.generation.agents import AgentGateway, agent_generate_function, session_opener
from services.rollout.generation.loss_masks import conversation_sample, is_conversation
from services.rollout.generation.partial import FINISHED
from services.rollout.generation.prompts import PromptEncoder
from services.rollout.generation.scoring import ServiceScorer, load_group_reward, score_group

if TYPE_CHECKING:
    from services.reward.client import RewardClient


@dataclass
class Generation:
    """What generating the groups of one rollout (or one eval) needs."""

    config: RolloutConfig
    encoder: PromptEncoder
    ctx: GenerateContext
    args: types.SimpleNamespace  # slime's `args`, for plugins
    generate_fn: Callable[..., Any]
    sampling_params: dict[str, Any]
    n_samples: int
    scorer: ServiceScorer
    evaluation: bool = False


def new_generation(config: RolloutConfig, encoder: PromptEncoder, reward: RewardClient, rollout_id: int, *,
                   evaluation: bool, http: Poster, router_url: str, gateway: AgentGateway | None = None,
                   **ctx_options: Any) -> Generation:
    """Load the job's plugins (once per path) and fix its sampling; InvalidArgument names what is wrong.

    ctx_options go to GenerateContext (sticky_routing, max_attempts, retry_delay_s, slots); `gateway` serves the
    sessions of an agent_function_path job.
    """
    if config.agent_function_path:
        fn = agent_generate_function(gateway, config.agent_function_path, config.agent_timeout_s)
    else:
        fn = load_generate_function(config.custom_generate_function_path)
    if config.group_rm:
        load_group_reward(config.custom_rm_path)
    job = config.job_id
    if evaluation:
        name, rid_prefix = f"eval at rollout {rollout_id} of job {job}", f"{job}-eval{rollout_id}"
        temperature, top_p, max_new_tokens, n = (config.eval_temperature, config.eval_top_p,
                                                 config.eval_max_response_len, config.n_samples_per_eval_prompt)
    else:
        name, rid_prefix = f"rollout {rollout_id} of job {job}", f"{job}-{rollout_id}"
        temperature, top_p, max_new_tokens, n = (config.rollout_temperature, config.rollout_top_p,
                                                 config.rollout_max_response_len, config.n_samples_per_prompt)
    top_k = config.eval_top_k if evaluation else config.rollout_top_k
    params = sampling_params(temperature=temperature, top_p=top_p, top_k=top_k,
                             max_new_tokens=max_new_tokens, stop=config.rollout_stop,
                             stop_token_ids=config.rollout_stop_token_ids)
    ctx = GenerateContext(http=http, router_url=router_url, name=name, rid_prefix=rid_prefix, **ctx_options)
    if config.args.get("lora_rank"):  # a LoRA job's samples come from its adapter, which the trainer syncs
        ctx.lora_name = lora_adapter_name(job)
        ctx.lora_versioned = config.args.get("lora_sync") == "disk"  # as the trainer resolved it
    ctx.open_session = session_opener(gateway, ctx, encoder, model=Path(config.tokenizer_path).name or "physarum",
                                      images=bool(config.multimodal_keys))
    ctx.scorer = ServiceScorer(reward, config)
    return Generation(config=config, encoder=encoder, ctx=ctx, args=plugin_args(config.args, router_url),
                      generate_fn=fn, sampling_params=params, n_samples=n, evaluation=evaluation,
                      scorer=ctx.scorer)


async def rate_group(gen: Generation, samples: list[Sample], what: str) -> list[sample_pb2.Sample | None]:
    """A generated group's signal: the teacher's log-probs (opd_teacher_url), then its rewards, or reward 0 under
    opd_only. Returns, beside each sample, the proto the reward service was sent (score_group), None where none was."""
    config = gen.config
    if config.opd_teacher_url:
        await teacher.score_group_with_teacher(gen.ctx.http, config.opd_teacher_url, samples,
                                               temperature=config.rollout_temperature, what=what)
    if config.opd_only:
        teacher.distillation_only(samples)
        return [None] * len(samples)
    return await score_group(gen.scorer, gen.args, samples, what)


def new_sample(prompt: Prompt, text: str, prompt_ids: list[int], j: int) -> PluginSample:
    """Sample j of the group answering `prompt` (slime's Sample): its tokens are the prompt's, its response empty."""
    return PluginSample(prompt=text, prompt_messages=prompt.messages, label=prompt.label,
                         metadata=dict(prompt.metadata), group_index=prompt.index, index=j, tokens=list(prompt_ids),
                         session_id=new_session_id(),
                         # its own list: a multi-turn generate function extends it with its observations' images
                         multimodal_inputs={"images": list(prompt.images)} if prompt.images else None)


async def generate_group(gen: Generation, samples: list[Sample]) -> list[Sample]:
    """Run the generate function on every unfinished sample of a group, concurrently; the first error fails it.
    A function that returns a list (slime's fan-out) puts all its samples in the group, renumbered in order."""
    use_context(gen.ctx)
    todo = [j for j, s in enumerate(samples) if s.status not in FINISHED]
    fresh = [j for j in todo if not samples[j].response_length] if _batches(gen) else []
    if len(fresh) < 2:
        fresh = []
    try:
        async with asyncio.TaskGroup() as tasks:
            running = {j: tasks.create_task(run_generate(
                gen.generate_fn, gen.args, samples[j], gen.sampling_params, evaluation=gen.evaluation,
                what=f"{gen.ctx.name}: prompt {samples[j].group_index} sample {j}")) for j in todo if j not in fresh}
            if fresh:
                batch = tasks.create_task(generate_fresh_batch(gen.args, [samples[j] for j in fresh],
                                                               gen.sampling_params, what=gen.ctx.name))
    except ExceptionGroup as group_err:
        raise group_err.exceptions[0] from None
    outputs = {j: running[j].result() for j in running}
    if fresh:
        outputs.update({j: [out] for j, out in zip(fresh, batch.result(), strict=True)})
    group = [out for j, s in enumerate(samples) for out in outputs.get(j, [s])]
    if gen.ctx.lora_name is not None:  # a LoRA job's: generated with its adapter, as every request named
        for sample in group:
            sample.lora_name = gen.ctx.lora_name
    if len(group) != len(samples):
        for position, sample in enumerate(group):
            sample.index = position
    return group


def _batches(gen: Generation) -> bool:
    """A group's fresh samples go out as one /generate (when the manager batches groups) under slime's default
    generate function, unless each sample routes by its own session (sticky policies) or there is nothing to
    generate."""
    return (gen.ctx.batch_groups and gen.generate_fn is generate and not gen.ctx.sticky_routing
            and gen.sampling_params["max_new_tokens"] > 0)


def sft_sample(encoder: PromptEncoder, prompt: Prompt, text: str, prompt_ids: list[int], index: int,
               weight_version: str, what: str, loss_mask_type: str = "qwen") -> Sample:
    """slime's sft rollout: a conversation trains on its assistant turns (loss_mask_type); a prompt on its label's
    tokens + eos. No generation; reward 0."""
    if is_conversation(prompt.messages):
        sample = conversation_sample(new_sample(prompt, text, prompt_ids, index), encoder, prompt.messages,
                                     loss_mask_type)
        sample.status, sample.weight_versions = Status.COMPLETED, [weight_version]
        return sample
    if not prompt.label or not isinstance(prompt.label, str):
        raise InvalidArgument(f"{what}: sft_loss needs a text label or a conversation with assistant turns, "
                              f"prompt {prompt.index} has neither (load the dataset with label_key)")
    eos = [] if encoder.eos_token_id is None else [encoder.eos_token_id]
    response_ids = encoder.encode_text(prompt.label) + eos
    sample = new_sample(prompt, text, prompt_ids, index)
    sample.tokens = prompt_ids + response_ids
    sample.response, sample.response_length = prompt.label, len(response_ids)
    sample.loss_mask, sample.rollout_log_probs = [1] * len(response_ids), [0.0] * len(response_ids)
    sample.status, sample.weight_versions, sample.reward = Status.COMPLETED, [weight_version], 0.0
    return sample
