"""Plugins written the way slime's docs and examples write them, with slime's imports only: a rollout function on
generate_and_rm and call_dynamic_filter, a generate function that scores its sample with async_rm, a filter, a data
source that makes its own prompts."""

from __future__ import annotations

import asyncio
import json
import os

from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput
from slime.rollout.data_source import DataSource
from slime.rollout.filter_hub.base_types import MetricGatherer, call_dynamic_filter
from slime.rollout.rm_hub import async_rm
from slime.rollout.sglang_rollout import GenerateState, generate, generate_and_rm, generate_and_rm_group
from slime.rollout.sglang_rollout import generate_rollout as generate_rollout_default
from slime.utils.async_utils import run
from slime.utils.misc import load_function
from slime.utils.types import Sample


def drop_prompt_one(args, samples, **kwargs):
    """A legacy filter: a plain bool (slime wraps it in DynamicFilterOutput)."""
    return samples[0].group_index != 1


def generate_rollout(args, rollout_id, data_source, evaluation=False):
    """slime's custom-rollout pattern: get groups, generate and score each sample with generate_and_rm, filter each
    group with call_dynamic_filter, until rollout_batch_size groups are kept; the dropped ones' count as metrics."""
    state = GenerateState(args)
    keep_fn = load_function(args.my_filter_path)
    gatherer = MetricGatherer()
    kept: list[list[Sample]] = []

    async def one_group(group):
        return list(await asyncio.gather(*(generate_and_rm(args, sample, state.sampling_params.copy())
                                           for sample in group)))

    while len(kept) < args.rollout_batch_size:
        groups = data_source.get_samples(1)
        group = run(one_group(groups[0]))
        verdict = call_dynamic_filter(keep_fn, args, group)
        if verdict.keep:
            kept.append(group)
        else:
            gatherer.on_dynamic_filter_drop("prompt_one")  # and the group is left out, as slime's rollout does
    return RolloutFnTrainOutput(samples=kept, metrics=gatherer.collect())


async def generate_then_score(args, sample, sampling_params):
    """A custom generate function that sets its own reward with async_rm, as slime's examples do."""
    sample = await generate(args, sample, sampling_params)
    sample.reward = await async_rm(args, sample)
    sample.metadata["scored_in_generate"] = True
    return sample


def eval_rollout(args, rollout_id, data_source, evaluation=False):
    """An eval function (slime's --eval-function-path): one made-up dataset, its rewards and truncation."""
    assert evaluation
    return RolloutFnEvalOutput(data={"made_up": {"rewards": [1.0, 0.0, 0.5], "truncated": [False, True, False]}},
                               metrics={"eval/made_up_calls": 1})


def rollout_with_slimes_eval(args, rollout_id, data_source, evaluation=False):
    """A rollout function that leaves evaluation to slime's default (sglang_rollout.generate_rollout's eval)."""
    from slime.rollout import sglang_rollout

    if evaluation:
        return sglang_rollout.generate_rollout(args, rollout_id, data_source, evaluation=True)
    return generate_rollout(args, rollout_id, data_source, evaluation=False)


def rollout_ignoring_evaluation(args, rollout_id, data_source, evaluation=False):
    """A rollout function that returns training groups even when asked to evaluate."""
    return RolloutFnTrainOutput(samples=[])


def eval_with_slimes_default(args, rollout_id, data_source, evaluation=False):
    """An --eval-function-path function: slime's default eval of the job's eval datasets, plus a metric of its own."""
    from slime.rollout import sglang_rollout

    output = sglang_rollout.generate_rollout(args, rollout_id, data_source, evaluation=True)
    return RolloutFnEvalOutput(data=output.data, metrics={"eval/by_eval_function": len(output.data)})


_OPENAI_ADAPTER = None


async def openai_adapter_generate(args, sample, sampling_params):
    """slime's coding-agent pattern on slime.agent.adapters.openai: open a session, run an OpenAI-API agent (the
    calculator conversation: a tool call, its result, the answer), drain the session into samples; the agent's
    model output parsed with slime.agent.parsing as a harness would."""
    import secrets

    from openai import AsyncOpenAI
    from slime.agent.adapters.common import flatten_content
    from slime.agent.adapters.openai import OpenAIAdapter
    from slime.agent.parsing import parse_model_output

    from tests.integration.gateway_fixtures import OPENAI_TOOL

    global _OPENAI_ADAPTER
    _OPENAI_ADAPTER = _OPENAI_ADAPTER or OpenAIAdapter(tokenizer=None, sglang_url="http://unused")
    adapter = _OPENAI_ADAPTER
    sid = f"slime-{secrets.token_hex(16)}"
    adapter.open_session(sid, sampling_defaults=sampling_params)
    try:
        async with AsyncOpenAI(base_url=adapter.url, api_key=sid, timeout=120.0, max_retries=0) as client:
            messages = [{"role": "user", "content": flatten_content(sample.prompt_messages[-1]["content"])}]
            first = await client.chat.completions.create(model="m", max_tokens=120, messages=messages,
                                                         tools=[OPENAI_TOOL])
            call = first.choices[0].message.tool_calls[0]
            messages += [first.choices[0].message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": "5"}]
            final = await client.chat.completions.create(model="m", max_tokens=120, messages=messages,
                                                         tools=[OPENAI_TOOL])
        parsed = parse_model_output(final.choices[0].message.content or "", tools_schema=[OPENAI_TOOL],
                                    tool_parser_name="qwen25", reasoning_parser_name=None)
        return await adapter.finish_session(sid, base_sample=sample, reward=1.0,
                                            extra_metadata={"harness": "openai", "final_text": parsed.text,
                                                            "tool": call.function.name})
    finally:
        await adapter.drop_session(sid)


async def fan_out_two(args, sample, sampling_params, evaluation=False):
    """A per-sample generate function (a sample's generate_function_path) that fans out into two samples, the second
    with a reward of its own; it records the evaluation flag it was given."""
    first = await generate(args, sample, sampling_params)
    second = Sample(prompt=first.prompt, tokens=list(first.tokens), response=first.response,
                    response_length=first.response_length, loss_mask=list(first.loss_mask or []),
                    rollout_log_probs=list(first.rollout_log_probs or []), status=first.status, reward=0.25,
                    group_index=first.group_index, metadata={"evaluation": evaluation})
    first.metadata["evaluation"] = evaluation
    return [first, second]


def rollout_with_fan_out(args, rollout_id, data_source, evaluation=False):
    """generate_and_rm on samples naming their own generate function: each returns a list, flattened per group."""
    state = GenerateState(args)
    groups = data_source.get_samples(args.rollout_batch_size)

    async def one_group(group):
        for sample in group:
            sample.generate_function_path = "tests.slime_compat.plugins.fan_out_two"
        outputs = await asyncio.gather(*(generate_and_rm(args, sample, dict(state.sampling_params))
                                         for sample in group))
        return [sample for output in outputs for sample in output]

    return [run(one_group(group)) for group in groups]  # a legacy plain list of groups


def rollout_with_own_sampling(args, rollout_id, data_source, evaluation=False):
    """slime's fully-async pattern: every group through generate_and_rm_group at once, with sampling params of its
    own (GenerateState's, 2 new tokens at temperature 0.5)."""
    state = GenerateState(args)
    groups = data_source.get_samples(args.rollout_batch_size)
    params = {**state.sampling_params, "max_new_tokens": 2, "temperature": 0.5}

    async def all_groups():
        return await asyncio.gather(*(generate_and_rm_group(args, group, sampling_params=params.copy(),
                                                            evaluation=False) for group in groups))

    return RolloutFnTrainOutput(samples=list(run(all_groups())))


async def generate_recording_dp_ranks(args, sample, sampling_params):
    """A generate function that records GenerateState's busy data-parallel ranks as it starts."""
    dp_counts = list(GenerateState(args).dp_counts)
    sample = await generate(args, sample, sampling_params)
    sample.metadata["dp_counts"] = dp_counts
    return sample


class CountingPrompts(DataSource):
    """A data source that makes its own prompts, as slime's DataSource interface allows: question k is "k+k=",
    labelled 2k, tagged with the instance that made it. Its position (the next k) is its state, saved under
    args.save as slime's data sources save theirs."""

    made = 0  # instances made in this process: a data source built again after a restart tags its prompts anew

    def __init__(self, args):
        self.args = args
        self.next = 0
        CountingPrompts.made += 1
        self.instance = CountingPrompts.made

    def get_samples(self, num_samples):
        groups = []
        for k in range(self.next, self.next + num_samples):
            groups.append([Sample(prompt=f"{k}+{k}=", label=str(2 * k), metadata={"made_by": self.instance})
                           for _ in range(self.args.n_samples_per_prompt)])
        self.next += num_samples
        return groups

    def add_samples(self, samples):
        raise RuntimeError("CountingPrompts takes no samples back")

    def save(self, rollout_id):
        os.makedirs(self.args.save, exist_ok=True)
        with open(os.path.join(self.args.save, f"counting_{rollout_id}.json"), "w") as out:
            json.dump({"next": self.next}, out)

    def load(self, rollout_id=None):
        path = os.path.join(self.args.save, f"counting_{rollout_id}.json")
        if os.path.exists(path):
            with open(path) as state:
                self.next = json.load(state)["next"]

    def __len__(self):
        return self.next


def rollout_failing_at(args, rollout_id, data_source, evaluation=False):
    """slime's default rollout function, except that at rollout args.fail_at it takes its prompts and fails (a
    rollout cut short by a crash)."""
    if rollout_id == args.fail_at:
        data_source.get_samples(args.rollout_batch_size)
        raise RuntimeError(f"rollout {rollout_id} fails on purpose")
    return generate_rollout_default(args, rollout_id, data_source, evaluation=evaluation)


_HARNESS_ADAPTERS: dict[str, object] = {}


async def _harness_generate(harness_name, sample, sampling_params):
    """slime's coding-agent pattern (examples/coding_agent_rl): open a session on the harness's adapter, run the
    agent CLI in a sandbox pointed at it, drain the session into samples; the CLI's exit code in their metadata."""
    import secrets

    from slime.agent.adapters import AnthropicAdapter, OpenAIAdapter
    from slime.agent.adapters.common import flatten_content
    from slime.agent.harness import ClaudeCodeHarness, CodexHarness
    from slime.agent.sandbox import LocalSandbox

    harness_cls, adapter_cls = {"claude_code": (ClaudeCodeHarness, AnthropicAdapter),
                                "codex": (CodexHarness, OpenAIAdapter)}[harness_name]
    adapter = _HARNESS_ADAPTERS.setdefault(harness_name, adapter_cls(tokenizer=None, sglang_url="http://unused"))
    sid = f"cagent-{secrets.token_hex(16)}"
    adapter.open_session(sid, sampling_defaults=sampling_params)
    try:
        async with LocalSandbox() as sb:
            await harness_cls().install_cli(sb)
            exit_code = await harness_cls().run(sb, workdir=str(sb.workdir), session_id=sid, adapter_url=adapter.url,
                                                time_budget_sec=240,
                                                prompt=flatten_content(sample.prompt_messages[-1]["content"]))
            transcript = await sb.read_file(f"{sb.workdir}/.harness/trajectory.jsonl")
        samples = await adapter.finish_session(sid, base_sample=sample, reward=1.0 if exit_code == 0 else 0.0,
                                               extra_metadata={"harness": harness_name, "agent_exit_code": exit_code,
                                                               "transcript_tail": transcript[-4000:]})
        return samples or sample
    finally:
        await adapter.drop_session(sid)


async def claude_code_generate(args, sample, sampling_params):
    return await _harness_generate("claude_code", sample, sampling_params)


async def codex_generate(args, sample, sampling_params):
    return await _harness_generate("codex", sample, sampling_params)
