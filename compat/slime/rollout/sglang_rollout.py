"""slime.rollout.sglang_rollout: GenerateState (tokenizer, sampling params, concurrency of a job's generation), the
default `generate`, for custom generate functions that build on them, and slime's default rollout function,
`generate_rollout`, over a data source, for rollout functions that wrap it (and for a job that names only a data
source or a buffer filter). Its groups are generated and scored as the rollout service's own (the job's generate
function, sampling and reward)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import random
import uuid
from collections.abc import Iterator
from typing import Any

from services.common.errors import FailedPrecondition
from services.common.samples import Prompt, Status
from services.rollout.engine_calls.generate import generate as _physarum_generate
from services.rollout.engine_calls.generate import load_generate_function, run_generate
from services.rollout.engine_calls.generate import sampling_params as _sampling_params
from services.rollout.generation import filters
from services.rollout.generation.drain import drain_surplus
from services.rollout.generation.groups import generate_group
from services.rollout.generation.partial import PartialGroups, prepare_resumed
from services.rollout.generation.rollout_function import FunctionRun, current_run, rate_once
from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput
from slime.rollout.rm_hub import batched_async_rm
from slime.utils.async_utils import run
from slime.utils.processing_utils import Tokenizer, load_processor, load_tokenizer


class GenerateState:
    """One per job (slime keeps one per process, for its one job): args, tokenizer, processor, the rollout's sampling
    params, a semaphore bounding the requests a plugin sends at once, and slime's data-parallel rank bookkeeping
    (dp_rank_context: the least-busy of args.sglang_dp_size ranks; bookkeeping only, as in slime: the router picks
    the engine)."""

    _states: dict[str, GenerateState] = {}

    def __new__(cls, args: Any) -> GenerateState:
        key = f"{getattr(args, 'job_id', '')}:{getattr(args, 'hf_checkpoint', '')}"
        state = cls._states.get(key)
        if state is None:
            state = cls._states[key] = super().__new__(cls)
            state._init(args)
        return state

    def _init(self, args: Any) -> None:
        self.args = args
        concurrency = getattr(args, "sglang_server_concurrency", None) or 512
        self.semaphore = asyncio.Semaphore(concurrency)
        self.sampling_params = _sampling_params(
            temperature=args.rollout_temperature, top_p=args.rollout_top_p, top_k=args.rollout_top_k,
            max_new_tokens=args.rollout_max_response_len, stop=list(getattr(args, "rollout_stop", None) or []),
            stop_token_ids=list(getattr(args, "rollout_stop_token_ids", None) or []))
        self.dp_counts = [0] * (getattr(args, "sglang_dp_size", None) or 1)
        self.dp_rank = 0
        self.reset()

    @contextlib.contextmanager
    def dp_rank_context(self) -> Iterator[int]:
        """A data-parallel rank among the least busy ones (at random), counted busy until the block ends."""
        least = min(self.dp_counts)
        dp_rank = random.choice([i for i, count in enumerate(self.dp_counts) if count == least])
        self.dp_counts[dp_rank] += 1
        self.dp_rank = dp_rank
        try:
            yield dp_rank
        finally:
            self.dp_counts[dp_rank] -= 1

    @property
    def tokenizer(self) -> Tokenizer:
        path = getattr(self.args, "hf_checkpoint", None)
        if not path:
            raise FailedPrecondition("slime.rollout.sglang_rollout.GenerateState.tokenizer: the job's args name no "
                                     "hf_checkpoint")
        return load_tokenizer(path)

    @property
    def processor(self) -> Any:
        """The model's processor (slime.utils.processing_utils: torch-free, input_ids with image tokens expanded);
        None for a text model."""
        path = getattr(self.args, "hf_checkpoint", None)
        return load_processor(path) if path else None

    def reset(self) -> None:
        self.remaining_batch_size = 0
        self.pendings: set[asyncio.Task] = set()
        self.aborted = False


def get_model_url(args: Any, model_name: str = "", endpoint: str = "/generate") -> str:
    """The router's URL (Physarum serves one model per job)."""
    return f"http://{args.sglang_router_ip}:{args.sglang_router_port}{endpoint}"


async def generate(args: Any, sample: Any, sampling_params: dict[str, Any]) -> Any:
    """slime's default generate: one /generate call continuing sample.tokens."""
    return await _physarum_generate(args, sample, sampling_params)


async def generate_and_rm(args: Any, sample: Any, sampling_params: dict[str, Any],
                          evaluation: bool = False) -> Any:
    """slime's per-sample step: a finished sample comes back as it is; otherwise the sample's generate_function_path,
    the job's custom_generate_function_path or slime's `generate` runs on it (under GenerateState's semaphore), and
    each sample it returns without a reward is scored through the reward service (not under group_rm). Returns
    what the generate function returned: one Sample or a list (slime's fan-out)."""
    if getattr(args, "partial_rollout", False) and getattr(args, "mask_offpolicy_in_partial_rollout", False) \
            and sample.response_length > 0:
        sample.loss_mask = [0] * sample.response_length
    if sample.status in (Status.COMPLETED, Status.TRUNCATED):
        return sample
    state = GenerateState(args)
    async with state.semaphore:
        if state.aborted:
            sample.status = Status.ABORTED
            return sample
        path = getattr(sample, "generate_function_path", None) or getattr(args, "custom_generate_function_path", None)
        fn = load_generate_function(path) if path else _physarum_generate
        what = f"slime.rollout.sglang_rollout.generate_and_rm: prompt {sample.group_index} sample {sample.index}"
        kwargs = {"evaluation": evaluation} if "evaluation" in inspect.signature(fn).parameters else {}
        with state.dp_rank_context():
            returned = await fn(args, sample, dict(sampling_params), **kwargs)
        outputs = await run_generate(_returning(returned), args, sample, sampling_params, evaluation=False,
                                     what=what)
    if getattr(args, "group_rm", False) or any(out.status == Status.ABORTED for out in outputs):
        return outputs if isinstance(returned, list) else outputs[0]
    unscored = [out for out in outputs if out.reward is None]
    if unscored:
        for out, reward in zip(unscored, await batched_async_rm(args, unscored), strict=True):
            out.reward = reward
    return outputs if isinstance(returned, list) else outputs[0]


def _returning(value: Any) -> Any:
    """A generate function that returns `value`: run_generate checks and finishes what a function returned."""
    async def returned(args: Any, sample: Any, sampling_params: dict[str, Any]) -> Any:
        return value
    returned.__qualname__ = "the generate function"
    return returned


def _run_of(what: str) -> FunctionRun:
    job = current_run()
    if job is None:
        raise FailedPrecondition(f"slime.rollout.sglang_rollout.{what}: runs inside a rollout function the rollout "
                                 "service runs (rollout_function_path)")
    return job


async def generate_and_rm_group(args: Any, group: list[Any], sampling_params: dict[str, Any] | None = None,
                                evaluation: bool = False) -> list[Any]:
    """slime's: the group generated with `sampling_params` (the keys it gives over the job's; None: the job's) and
    scored as the service does its own (the job's generate function and reward; each sample without a session_id
    gets one); an aborted group comes back unscored, one asked for after GenerateState's abort as it was given. The
    group holds one dp_rank_context while it generates (Physarum sends a group's fresh samples to one engine
    together)."""
    gen = _run_of("generate_and_rm_group").gen
    state = GenerateState(args)
    if state.aborted:
        return group
    for sample in group:
        if getattr(sample, "session_id", "") is None:
            sample.session_id = str(uuid.uuid4())
    if any(sample.response_length for sample in group):  # a partial group given back by an earlier rollout
        prepare_resumed(group, gen.config.mask_offpolicy_in_partial_rollout)
    if sampling_params is not None or (evaluation and not gen.evaluation):
        params = gen.sampling_params if sampling_params is None else {**gen.sampling_params, **sampling_params}
        gen = dataclasses.replace(gen, sampling_params=params, evaluation=evaluation or gen.evaluation)
    with state.dp_rank_context():
        samples = await generate_group(gen, group)
    if not gen.ctx.aborting and not any(s.status == Status.ABORTED for s in samples):
        await rate_once(gen, samples, f"{gen.ctx.name}: prompt {samples[0].group_index}")
    return samples


async def generate_rollout_async(args: Any, rollout_id: int,
                                 data_source: Any) -> tuple[RolloutFnTrainOutput, list[list[Any]]]:
    """slime's default rollout: groups of over_sampling_batch_size prompts from `data_source` (get_samples) until
    rollout_batch_size are kept past the dynamic filter, then the rest aborted; with partial_rollout the aborted
    groups come back with what they generated (for add_samples), otherwise they are cancelled."""
    job = _run_of("generate_rollout")
    config = job.gen.config  # the job's settings, typed (args holds the same, as slime's flags)
    path = config.dynamic_sampling_filter_path
    dynamic_filter = filters.load_filter(path) if path else None
    target = config.rollout_batch_size
    data: list[list[Any]] = []
    pending: dict[asyncio.Task, Prompt] = {}
    remaining = submitted = 0  # groups kept or generating (slime's remaining_batch_size); groups asked for
    while len(data) < target:
        while remaining < target:
            groups = await asyncio.to_thread(data_source, config.over_sampling_batch_size or target)
            if not groups:
                raise FailedPrecondition(f"{job.gen.ctx.name}: the data source gave no groups")
            for group in groups:  # a placeholder prompt per group: drain_surplus keys what it keeps by it
                pending[asyncio.create_task(generate_and_rm_group(args, group))] = Prompt(
                    job_id=config.job_id, index=submitted, epoch=0)
                submitted += 1
            remaining += len(groups)
        done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            del pending[task]
            group = task.result()
            output = filters.call_filter(dynamic_filter, args, group) if dynamic_filter else None
            if output is not None and filters.should_drop(output, num_remaining=remaining, target=target):
                remaining -= 1
                job.dropped.append(group)  # its prompt is used up for the epoch, as in the service's loop
                job.drops[filters.drop_metric(output.reason)] += 1
                continue
            if len(data) < target:
                data.append(group)
    aborted = PartialGroups()
    if pending:
        await drain_surplus(job.gen, rollout_id, pending, job.aborter, aborted)
    return RolloutFnTrainOutput(samples=data, metrics={}), aborted.drained()


def generate_rollout(args: Any, rollout_id: int, data_source: Any,
                     evaluation: bool = False) -> RolloutFnTrainOutput | RolloutFnEvalOutput:
    """slime's default rollout function: generate_rollout_async on data_source.get_samples, the aborted groups given
    back to the data source; with evaluation=True, slime's eval_rollout: every eval dataset generated and scored
    (the rollout service's eval, each dataset's own settings) as {name: {rewards, truncated, samples}}."""
    if evaluation:
        return RolloutFnEvalOutput(data=run(eval_rollout(args, rollout_id)))
    output, aborted_samples = run(generate_rollout_async(args, rollout_id, data_source.get_samples))
    if aborted_samples:
        data_source.add_samples(aborted_samples)
    return output


async def eval_rollout(args: Any, rollout_id: int) -> dict[str, dict[str, list[Any]]]:
    """slime's eval data of the job's eval datasets, their samples in prompt order."""
    job = _run_of("eval_rollout")
    if job.eval_groups is None:
        raise FailedPrecondition("slime.rollout.sglang_rollout.eval_rollout: runs inside an eval the rollout service "
                                 "runs")
    data = {}
    for name, groups in (await job.eval_groups()).items():
        samples = [sample for group in groups for sample in group]
        data[name] = {"rewards": [s.reward for s in samples], "truncated": [s.status == Status.TRUNCATED
                                                                           for s in samples], "samples": samples}
    return data


__all__ = ["GenerateState", "generate", "generate_and_rm", "generate_and_rm_group", "generate_rollout",
           "generate_rollout_async", "eval_rollout", "get_model_url", "load_tokenizer"]
