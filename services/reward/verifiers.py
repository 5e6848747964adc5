"""Built-in scorers (slime's --rm-type), picked per sample: metadata["rm_type"] wins over the job's rm_type, and a
"boxed_" prefix scores only the response's last \\boxed{} content, as slime does.

The rule-based ones run in worker threads (sympy may be slow) unless the caller is a reward worker process; the
caller's per-sample timeout rules.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any

from services.common.samples import Sample
from services.common.settings.rewards import RM_TYPES, check_rm_type
from services.reward.rm.boxed import boxed_answer
from services.reward.rm.choice import gpqa_reward
from services.reward.rm.dapo import dapo_reward
from services.reward.rm.math import deepscaler_reward, math_reward
from services.reward.rm.remote import remote_reward
from services.reward.rm.text import f1_reward

BOXED_PREFIX = "boxed_"


def exact_match(response: str, label: Any) -> float:
    """1.0 if response and label are equal after stripping surrounding whitespace, else 0.0 (Physarum's own)."""
    return 1.0 if response.strip() == str(label).strip() else 0.0


# (response, label, metadata) -> score
_RULES: dict[str, Callable[[str, Any, dict[str, Any]], Any]] = {
    "exact_match": lambda r, label, m: exact_match(r, label),
    "math": lambda r, label, m: math_reward(r, label),
    "deepscaler": lambda r, label, m: deepscaler_reward(r, label),
    "dapo": lambda r, label, m: dapo_reward(r, label),
    "f1": lambda r, label, m: f1_reward(r, label),
    "gpqa": lambda r, label, m: gpqa_reward(r, label, metadata=m),
    "random": lambda r, label, m: random.randint(0, 1),
}
assert set(_RULES) | {"remote_rm"} == set(RM_TYPES), "services.common.settings.rewards.RM_TYPES lists every built-in"


def sample_rm_type(sample: Sample, job_rm_type: str) -> str:
    """slime's choice: the sample's metadata["rm_type"], else the job's."""
    metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
    return str(metadata.get("rm_type") or job_rm_type or "").strip()


async def score_builtin(sample: Sample, job_rm_type: str, args: dict[str, Any], *, in_thread: bool = True) -> Any:
    """The sample's score under its rm_type; raises (failing only this sample) for an unknown or unset one. A rule
    runs in a worker thread unless `in_thread` is False (a reward worker process: nothing else waits on its loop).
    Reads only the sample's prompt, response, label, metadata and index: a reward worker decodes no more of it
    (`one_sample.as_sample`)."""
    rm_type = sample_rm_type(sample, job_rm_type)
    check_rm_type(rm_type, where=f"sample {sample.index}")
    response = sample.response
    if rm_type.startswith(BOXED_PREFIX):
        response = boxed_answer(response) or ""
        rm_type = rm_type[len(BOXED_PREFIX):]
    if rm_type == "remote_rm":
        # slime posts the sample as it is, even under boxed_remote_rm
        return await remote_reward(str(args.get("rm_url") or ""), sample.prompt, sample.response, sample.label)
    if not in_thread:
        return _RULES[rm_type](response, sample.label, sample.metadata)
    return await asyncio.to_thread(_RULES[rm_type], response, sample.label, sample.metadata)


def check_job_rm_type(rm_type: str) -> None:
    """A request's rm_type must be a built-in (or empty: then every sample's metadata names one)."""
    if rm_type:
        check_rm_type(rm_type)

