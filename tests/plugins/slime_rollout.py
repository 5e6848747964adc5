"""A rollout function, a data source and a buffer filter with slime's signatures, written as a slime user writes them
(slime's imports only). The function over-samples one group per rollout and gives it back ungenerated
(add_samples), as slime's rollout gives back aborted groups; the filter takes given-back groups newest first. Each
leaves a mark in the samples' metadata, so a test reading the buffer sees who did what."""

from __future__ import annotations

import asyncio
import json
import os

from slime.rollout.base_types import RolloutFnTrainOutput
from slime.rollout.data_source import RolloutDataSourceWithBuffer
from slime.rollout.sglang_rollout import GenerateState, generate
from slime.utils.async_utils import run
from slime.utils.types import Sample

PRESET_REWARD = 0.5  # the function's own reward for its first group; the others are left to the job's reward


class TaggedDataSource(RolloutDataSourceWithBuffer):
    """slime's buffered data source, marking each sample with the rollout it was loaded for and the data source."""

    def __init__(self, args):
        super().__init__(args)
        self.loaded_from = None

    def get_samples(self, num_samples):
        groups = super().get_samples(num_samples)
        for group in groups:
            for sample in group:
                sample.metadata.setdefault("data_source", type(self).__name__)
                sample.metadata["loaded_from"] = self.loaded_from
        return groups

    def save(self, rollout_id):
        os.makedirs(self.args.save, exist_ok=True)
        with open(os.path.join(self.args.save, f"data_source_{rollout_id}.json"), "w") as out:
            json.dump({"buffered": len(self.buffer)}, out)

    def load(self, rollout_id=None):
        self.loaded_from = rollout_id


def take_newest(args, rollout_id, buffer, num_samples):
    """slime's buffer filter: the last groups given back first, marked with the rollout that took them."""
    taken = buffer[-num_samples:]
    del buffer[-num_samples:]
    for group in taken:
        for sample in group:
            sample.metadata["taken_by_filter"] = rollout_id
    return taken


def generate_rollout(args, rollout_id, data_source, evaluation=False):
    groups = data_source.get_samples(args.rollout_batch_size + 1)
    kept, extra = groups[: args.rollout_batch_size], groups[args.rollout_batch_size:]
    data_source.add_samples(extra)  # not generated: the next rollout takes it out through the buffer filter
    state = GenerateState(args)

    async def generate_all():
        todo = [sample for group in kept for sample in group if sample.status == Sample.Status.PENDING]
        await asyncio.gather(*(generate(args, sample, dict(state.sampling_params)) for sample in todo))

    run(generate_all())
    for sample in kept[0]:
        sample.reward = PRESET_REWARD
    for group in kept:
        for sample in group:
            sample.metadata["rollout_function"] = rollout_id
    return RolloutFnTrainOutput(samples=kept, metrics={"rollout/function_groups": len(kept), "note": "not a number"})


def returns_too_few(args, rollout_id, data_source, evaluation=False):
    return data_source.get_samples(1)[:0]


def returns_made_up_groups(args, rollout_id, data_source, evaluation=False):
    data_source.get_samples(args.rollout_batch_size)
    return [[Sample(prompt="?", tokens=[1, 2], response_length=1, group_index=999)]
            for _ in range(args.rollout_batch_size)]


async def async_rollout(args, rollout_id, data_source, evaluation=False):
    return []


def no_evaluation(args, rollout_id, data_source):
    return []


def two_params_filter(args, buffer):
    return buffer


class NoCountDataSource(RolloutDataSourceWithBuffer):
    def get_samples(self):
        return super().get_samples(1)
