"""One sample's score, computed inside a reward worker process: call the built-in verifier or the user's function,
and turn what it returns into a ScoreResult. Which process runs it, and its timeout, are left to `workers`.
"""

from __future__ import annotations

import functools
import math
import numbers
import types
from collections.abc import Awaitable, Callable
from typing import Any

from services.common import plugins
from services.common.gen.physarum.v1 import sample_pb2
from services.common.plugin_sample import PluginSample
from services.common.samples import Sample, label_from_proto, sample_from_proto, struct_to_dict
from services.reward import verifiers
from services.reward.client import ScoreResult


def restore_ints(value: Any) -> Any:
    """protobuf Struct carries every number as a double; give whole numbers back as int (args.n_samples_per_prompt)."""
    if isinstance(value, dict):
        return {k: restore_ints(v) for k, v in value.items()}
    if isinstance(value, list):
        return [restore_ints(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def as_sample(sample: Sample | bytes | sample_pb2.Sample, whole: bool = True) -> Sample:
    """A task's sample; one that came as a proto (from the gRPC server) is decoded here, its metadata's whole
    numbers given back as ints. whole=False decodes only what a built-in rule reads (`verifiers.score_builtin`: the
    prompt, response, label, metadata and index): a third of the cost of the whole sample, per sample."""
    if isinstance(sample, Sample):
        return sample
    msg = sample_pb2.Sample.FromString(sample) if isinstance(sample, bytes) else sample
    if whole:
        decoded = sample_from_proto(msg)
        decoded.metadata = restore_ints(decoded.metadata)
        return decoded
    return Sample(prompt=msg.prompt, response=msg.response, label=label_from_proto(msg), index=msg.index,
                  metadata=restore_ints(struct_to_dict(msg.metadata)) if msg.HasField("metadata") else {})


@functools.cache
def load_reward_function(path: str) -> Callable[..., Awaitable[Any]]:
    """Import a custom_rm_path once per path; InvalidArgument if it is missing or has the wrong signature."""
    return plugins.load_function(path, flag="custom_rm_path", expected="async def f(args, sample) -> float | dict",
                                 is_async=True, num_params=2)


async def call_scorer(kind: str, target: str, sample: Sample, args: dict[str, Any]) -> Any:
    """What the scorer returns for one sample (a user function gets slime's Sample); runs inside a worker process,
    never in the service."""
    if kind == "custom":
        return await load_reward_function(target)(types.SimpleNamespace(**args), PluginSample.from_record(sample))
    return await verifiers.score_builtin(sample, target, args, in_thread=False)  # this process scores nothing else


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real)


def to_result(value: Any, reward_key: str, name: str) -> ScoreResult:
    """A scorer's return value as a ScoreResult: a finite number, or a dict whose reward_key picks one."""
    scores: dict[str, float] = {}
    if isinstance(value, dict):
        scores = {str(k): float(v) for k, v in value.items() if _is_number(v)}
        keys = ", ".join(sorted(map(str, value)))
        if not reward_key:
            return ScoreResult(0.0, False, f"{name} returned a dict (keys: {keys}); set reward_key to one", scores)
        if reward_key not in value:
            return ScoreResult(0.0, False, f"{name}: reward_key {reward_key!r} not in its result (keys: {keys})",
                               scores)
        value = value[reward_key]
        name = f"{name} [{reward_key!r}]"
    if not _is_number(value) or not math.isfinite(float(value)):
        return ScoreResult(0.0, False, f"{name} returned {value!r}; expected a finite float or a dict of them",
                           scores)
    return ScoreResult(float(value), True, "", scores)
