"""Eval (slime's eval rollout): generate and score every prompt of the eval datasets, and the eval/<name> metrics
(mean reward, pass@k by the unbiased estimator, truncated ratio), of these groups or of an eval function's output.
No filters, no over-sampling, no partial rollout.
"""

from __future__ import annotations

import asyncio
import logging
import math
import numbers
import statistics
import time
from typing import TYPE_CHECKING, Any

from services.common.errors import InvalidArgument, PhysarumError
from services.common.samples import Prompt, Sample, Status
from services.rollout.generation.groups import Generation, generate_group, new_sample
from services.rollout.generation.scoring import score_group

if TYPE_CHECKING:
    from services.buffer.client import BufferClient

log = logging.getLogger(__name__)


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """The unbiased estimator of Chen et al. 2021 (Codex): 1 - C(n - c, k) / C(n, k), as a stable product."""
    if not 0 < k <= num_samples or not 0 <= num_correct <= num_samples:
        raise ValueError(f"pass@{k} of {num_correct} correct in {num_samples} samples is undefined")
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(num_samples - num_correct + 1, num_samples + 1))


def pass_ks(num_samples: int) -> list[int]:
    """k = 1, 2, 4, ... up to n, as slime logs them; none for one sample per prompt."""
    if num_samples < 2:
        return []
    return [2**i for i in range(int(math.log2(num_samples)) + 1)]


def eval_metrics(name: str, groups: list[list[Sample]]) -> dict[str, float]:
    """eval/<name> (mean reward), eval/<name>-pass@k (mean over prompts; a sample passes when its reward is 1, as
    in slime), eval/<name>-truncated_ratio, for groups of equal size (one per prompt)."""
    samples = [s for group in groups for s in group]
    if not samples:
        return {}
    metrics = {f"eval/{name}": statistics.fmean(s.reward for s in samples),
               f"eval/{name}-truncated_ratio": sum(s.status == Status.TRUNCATED for s in samples) / len(samples)}
    n = len(groups[0])
    for k in pass_ks(n):
        metrics[f"eval/{name}-pass@{k}"] = statistics.fmean(
            pass_at_k(n, sum(s.reward == 1.0 for s in group), k) for group in groups)
    return metrics


async def run_eval(buffer: BufferClient, gens: dict[str, Generation], rollout_id: int) -> dict[str, float]:
    """The eval/* metrics of eval_groups."""
    start = time.monotonic()
    metrics: dict[str, float] = {}
    for name, groups in (await eval_groups(buffer, gens, rollout_id)).items():
        metrics.update(eval_metrics(name, groups))
    log.info("eval at rollout %d done in %.1f s: %s", rollout_id, time.monotonic() - start, metrics)
    return metrics


async def eval_groups(buffer: BufferClient, gens: dict[str, Generation],
                      rollout_id: int) -> dict[str, list[list[Sample]]]:
    """Every eval dataset is a buffer job "<job_id>.eval.<name>": all its prompts are leased, generated (n samples
    each), scored and given back, so the next eval leases them again. `gens`: each dataset's generation (its own
    sampling, samples per prompt, keys and reward, as its config says). Returns each dataset's groups, in prompt
    order."""
    out: dict[str, list[list[Sample]]] = {}
    for name, gen in gens.items():
        config, path = gen.config, gen.config.eval_datasets[name]
        eval_job = f"{config.job_id}.eval.{name}"
        info = await asyncio.to_thread(
            buffer.load_dataset, eval_job, path, input_key=config.eval_input_key, label_key=config.eval_label_key,
            metadata_key=config.metadata_key, apply_chat_template=config.apply_chat_template,
            multimodal_keys=config.multimodal_keys)
        if not info.num_prompts:
            raise InvalidArgument(f"eval dataset {name} ({path}): no usable prompts ({'; '.join(info.errors)})")
        prompts = await asyncio.to_thread(buffer.lease_prompts, eval_job, rollout_id, info.num_prompts,
                                          config.lease_timeout_s)
        try:
            async with asyncio.TaskGroup() as tasks:
                running = [tasks.create_task(_eval_group(gen, prompt)) for prompt in prompts]
        except ExceptionGroup as group_err:
            raise group_err.exceptions[0] from None
        finally:
            await _give_back(buffer, eval_job, prompts)
        out[name] = [task.result() for task in running]
    return out


def function_eval_metrics(data: dict[str, Any], extra: dict[str, Any] | None,
                          samples_per_prompt: dict[str, int]) -> dict[str, float]:
    """slime's eval log of an eval function's RolloutFnEvalOutput: per dataset eval/<name> (mean of `rewards`),
    eval/<name>-truncated_ratio (of `truncated`), eval/<name>-pass@k (the rewards taken in prompts of the
    dataset's samples_per_prompt, as slime's pass rate groups them); the function's numeric metrics join them."""
    metrics = {str(k): float(v) for k, v in (extra or {}).items() if isinstance(v, numbers.Real)}
    for name, values in data.items():
        rewards = values.get("rewards") if isinstance(values, dict) else None
        if not isinstance(rewards, list) or not rewards or not all(isinstance(r, numbers.Real) for r in rewards):
            raise InvalidArgument(f"eval function: data[{name!r}] needs `rewards`, a non-empty list of numbers "
                                  "(slime's RolloutFnEvalOutput.data: {dataset: {rewards, truncated, samples}})")
        metrics[f"eval/{name}"] = statistics.fmean(rewards)
        if truncated := values.get("truncated"):
            metrics[f"eval/{name}-truncated_ratio"] = sum(map(bool, truncated)) / len(truncated)
        n = samples_per_prompt.get(name, 1)
        if len(rewards) % n == 0:
            prompts = [rewards[i:i + n] for i in range(0, len(rewards), n)]
            for k in pass_ks(n):
                metrics[f"eval/{name}-pass@{k}"] = statistics.fmean(
                    pass_at_k(n, sum(r == 1.0 for r in group), k) for group in prompts)
    return metrics


async def _eval_group(gen: Generation, prompt: Prompt) -> list[Sample]:
    text, prompt_ids = gen.encoder.encode(prompt)
    samples = await generate_group(gen, [new_sample(prompt, text, prompt_ids, j) for j in range(gen.n_samples)])
    await score_group(gen.scorer, gen.args, samples, f"{gen.ctx.name}: prompt {prompt.index}")
    return samples


async def _give_back(buffer: BufferClient, eval_job: str, prompts: list[Prompt]) -> None:
    try:
        await asyncio.to_thread(buffer.return_prompts, eval_job, [p.lease_id for p in prompts])
    except PhysarumError as err:
        log.warning("eval job %s: could not return %d leases (they expire): %s", eval_job, len(prompts), err)
