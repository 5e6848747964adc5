"""The job's buffer as slime's data source reads it (--data-source-path, for a rollout function): one JobPrompts
per job, bound by job id, through which slime.rollout.data_source's classes lease prompts as groups of slime's
Samples. Each group holds its prompt's lease until the group is written, kept (add_samples) or given back, so no
prompt is lost. A data source that makes its own prompts feeds the buffer through a PromptFeeder when the buffer
runs short. Called from the rollout function's worker thread; knows nothing of gRPC.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from services.common.errors import FailedPrecondition, InvalidArgument, NotFound
from services.common.plugin_sample import PluginSample
from services.common.samples import Prompt, Sample
from services.common.settings.rollout import RolloutConfig
from services.rollout.generation.groups import new_sample
from services.rollout.generation.prompts import PromptEncoder

if TYPE_CHECKING:
    from services.buffer.client import BufferClient

MAX_LEASE_CALLS = 8  # LeasePrompts calls per get_samples, each short only by prompts renewed here
MAX_FEED_CALLS = 64  # get_samples calls per feed of a data source that makes its own prompts
GROUP_KEY_ATTR = "_physarum_group"  # on each sample a group leased here holds: which prompt (lease) it answers


class PromptFeeder:
    """A data source that makes its own prompts (a generator, an environment): what its get_samples yields goes to
    the buffer at its position (the count it has yielded), so the buffer leases it like a dataset's prompt. The
    position is saved beside the source's own state (save) and read back with it (load): a source that resumed
    yields again prompts the buffer has already, which keep their first copy, so none is served twice or lost."""

    def __init__(self, source: Any, buffer: BufferClient, job_id: str) -> None:
        self.source, self.buffer, self.job_id = source, buffer, job_id
        self.position = 0
        self.broken = False  # an append failed after the source moved on: it must be built and loaded again

    def load(self, rollout_id: int) -> None:
        self.source.load(rollout_id)
        self.position = self.buffer.load_source_position(self.job_id, rollout_id) if rollout_id >= 0 else 0

    def save(self, rollout_id: int) -> None:
        self.buffer.save_source_position(self.job_id, rollout_id, self.position)
        self.source.save(rollout_id)

    def feed(self, num_prompts: int) -> int:
        """Ask the source for groups until num_prompts new prompts are stored (or it yields none); the number
        stored. A source behind the buffer (it resumed) is asked for what it must yield again to catch up."""
        total, behind = 0, 0
        for _ in range(MAX_FEED_CALLS):
            if total >= num_prompts:
                break
            groups = self.source.get_samples(num_prompts - total + behind)
            prompts = [_prompt_of_made(group, self.job_id) for group in groups or []]
            if not prompts:
                break
            try:
                appended, stored = self.buffer.append_prompts(self.job_id, self.position, prompts)
            except Exception:
                self.broken = True
                raise
            self.position += len(prompts)
            total, behind = total + appended, max(0, stored - self.position)
        return total


def _prompt_of_made(group: Any, job_id: str) -> Prompt:
    """The prompt of a group a source made: its first sample's prompt (text, or chat messages), label and
    metadata."""
    sample = group[0] if isinstance(group, list) and group else None
    prompt = getattr(sample, "prompt", None)
    if not isinstance(prompt, str | list):
        raise InvalidArgument(f"data source: get_samples returned {type(group).__name__} with no prompt; expected "
                              "groups (lists) of Samples whose prompt is a string or a list of chat messages")
    metadata = getattr(sample, "metadata", None) or {}
    if not isinstance(metadata, dict):
        raise InvalidArgument(f"data source: a sample's metadata is {type(metadata).__name__}, not a dict")
    label = getattr(sample, "label", None)
    return Prompt(job_id=job_id, index=0, epoch=0, prompt=prompt if isinstance(prompt, str) else "",
                  messages=[] if isinstance(prompt, str) else [dict(m) for m in prompt],
                  label="" if label is None else label, metadata=metadata)


class JobPrompts:
    """A job's leased prompts: `lease_groups` for get_samples, `keep`/`take` as groups go into and out of a data
    source's own buffer, `prompt_of` to write a returned group under its prompt, `release` at a rollout's end."""

    def __init__(self, buffer: BufferClient, encoder: PromptEncoder, config: RolloutConfig) -> None:
        self.buffer, self.encoder, self.config = buffer, encoder, config
        self.rollout_id = 0  # the rollout being generated: leases are taken for it
        self._lock = threading.Lock()
        self._next_key = 0
        self._leased: dict[int, Prompt] = {}  # group key -> its prompt, lease held
        self._kept: set[int] = set()  # keys of groups a data source holds across rollouts (add_samples)
        self.feeder: PromptFeeder | None = None  # the job's data source, when it makes its own prompts

    def lease_groups(self, num_groups: int, n_samples: int) -> list[list[PluginSample]]:
        """Lease `num_groups` prompts (fewer only if the buffer has fewer) as groups of n_samples fresh samples each:
        the prompt's tokens, label and metadata, group_index the prompt's index, as the service's loop makes them.
        A prompt served again while a group of it is held here (its lease expired, e.g. a kept group waiting longer
        than lease_timeout_s) renews that group's lease instead of making a second group of it."""
        groups: list[list[PluginSample]] = []
        for _ in range(MAX_LEASE_CALLS):
            if len(groups) >= num_groups:
                break
            prompts = self._lease(num_groups - len(groups))
            if not prompts and self.feeder is not None and self.feeder.feed(num_groups - len(groups)):
                continue  # the source's new prompts are leased on the next pass
            if not prompts:
                break
            groups += [self._group(prompt, n_samples) for prompt in prompts if not self._renews(prompt)]
        return groups

    def _lease(self, count: int) -> list[Prompt]:
        try:
            return self.buffer.lease_prompts(self.config.job_id, self.rollout_id, count, self.config.lease_timeout_s)
        except NotFound:
            if self.feeder is None:
                raise
            return []  # a source that makes its own prompts has stored none yet

    def _renews(self, prompt: Prompt) -> bool:
        with self._lock:
            held = next((key for key, p in self._leased.items() if (p.epoch, p.index) == (prompt.epoch, prompt.index)),
                        None)
            if held is not None:
                self._leased[held] = prompt
            return held is not None

    def _group(self, prompt: Prompt, n_samples: int) -> list[PluginSample]:
        text, prompt_ids = self.encoder.encode(prompt)
        with self._lock:
            key, self._next_key = self._next_key, self._next_key + 1
            self._leased[key] = prompt
        group = [new_sample(prompt, text, prompt_ids, j) for j in range(n_samples)]
        for sample in group:
            setattr(sample, GROUP_KEY_ATTR, key)
        return group

    def forget_kept(self) -> list[str]:
        """A trainer that resumed restored the buffer, ending every lease: the kept groups are gone with their data
        source; their lease ids are returned (the buffer ignores ended ones)."""
        with self._lock:
            ids = [self._leased.pop(key).lease_id for key in self._kept if key in self._leased]
            self._kept.clear()
            return ids

    def keep(self, groups: list[list[Sample]]) -> None:
        """These groups stay with the data source past this rollout: their leases are not given back."""
        with self._lock:
            self._kept.update(key for group in groups if (key := _key(group)) in self._leased)

    def take(self, groups: list[list[Sample]]) -> None:
        """These kept groups are taken back out for the rollout being generated."""
        with self._lock:
            self._kept.difference_update(_key(group) for group in groups)

    def prompt_of(self, group: list[Sample]) -> Prompt | None:
        """The leased prompt a returned group answers: by the key its samples carry, else by group_index when one
        leased prompt alone has that index (a function that built new samples keeps group_index)."""
        with self._lock:
            key = _key(group)
            if key in self._leased:
                return self._leased[key]
            index = group[0].group_index if group else None
            matches = [prompt for prompt in self._leased.values() if prompt.index == index]
            return matches[0] if len(matches) == 1 else None

    def written(self, prompts: list[Prompt]) -> None:
        """These prompts' groups are in the buffer (their leases acked)."""
        done = {prompt.lease_id for prompt in prompts}
        with self._lock:
            for key in [k for k, prompt in self._leased.items() if prompt.lease_id in done]:
                del self._leased[key]
                self._kept.discard(key)

    def release(self) -> list[str]:
        """The lease ids of prompts leased and neither written nor kept: the caller gives them back."""
        with self._lock:
            unused = [key for key in self._leased if key not in self._kept]
            return [self._leased.pop(key).lease_id for key in unused]

    def num_prompts(self) -> int:
        try:
            return self.buffer.stats(self.config.job_id).num_prompts
        except NotFound:
            if self.feeder is None:
                raise
            return 0


def _key(group: list[Sample]) -> int | None:
    return next((key for sample in group if (key := getattr(sample, GROUP_KEY_ATTR, None)) is not None), None)


_BOUND: dict[str, JobPrompts] = {}


def bind(job_id: str, prompts: JobPrompts) -> None:
    _BOUND[job_id] = prompts


def unbind(job_id: str) -> None:
    _BOUND.pop(job_id, None)


def prompts_for(args: Any) -> JobPrompts:
    """The bound JobPrompts of args.job_id; FailedPrecondition outside a rollout function the service runs."""
    job_id = getattr(args, "job_id", "")
    prompts = _BOUND.get(job_id)
    if prompts is None:
        raise FailedPrecondition(f"slime.rollout.data_source: job {job_id!r} has no prompts bound: its data source is "
                                 "built by the rollout service, for a job with rollout_function_path")
    return prompts
