"""Partial rollout (slime's --partial-rollout): groups drained by an abort keep their tokens for a later rollout.

The buffer holds prompts, not samples, so the manager keeps the drained groups here, keyed by prompt (job, epoch,
index), and gives their leases back: the prompt is never lost, and the buffer serves returned prompts first. When the
prompt is leased again its group resumes from the kept tokens. A restarted manager has nothing kept: the prompt is
then generated afresh, which loses work but no data.
"""

from __future__ import annotations

import collections
import logging

from services.common.samples import Prompt, Sample, Status

log = logging.getLogger(__name__)

MAX_KEPT_GROUPS = 4096  # beyond this the oldest kept groups are forgotten (their prompts start over)
FINISHED = (Status.COMPLETED, Status.TRUNCATED)

Key = tuple[str, int, int]


class PartialGroups:
    """In-progress groups by prompt; `keep` after a drain, `take` when the prompt is leased again."""

    def __init__(self, max_groups: int = MAX_KEPT_GROUPS) -> None:
        self.max_groups = max_groups
        self._groups: collections.OrderedDict[Key, list[Sample]] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._groups)

    @staticmethod
    def _key(job_id: str, prompt: Prompt) -> Key:
        return (job_id, prompt.epoch, prompt.index)

    def keep(self, job_id: str, prompt: Prompt, samples: list[Sample], rollout_id: int) -> bool:
        """Keep a drained group unless nothing was generated for it; returns whether it was kept."""
        if not any(s.response_length for s in samples):
            return False
        for sample in samples:
            if sample.response_length:
                sample.metadata.setdefault("start_rollout_id", rollout_id)
            if sample.status not in FINISHED:
                sample.status = Status.ABORTED
        key = self._key(job_id, prompt)
        self._groups[key] = samples
        self._groups.move_to_end(key)
        while len(self._groups) > self.max_groups:
            (job, epoch, index), _ = self._groups.popitem(last=False)
            log.warning("partial rollout: forgot the kept group of prompt %d (epoch %d) of job %s (over %d kept)",
                        index, epoch, job, self.max_groups)
        return True

    def take(self, job_id: str, prompt: Prompt, prompt_text: str) -> list[Sample] | None:
        """The kept group of this prompt, if any (and if it was made from the same prompt text)."""
        samples = self._groups.pop(self._key(job_id, prompt), None)
        if samples is not None and samples[0].prompt != prompt_text:
            return None  # a job id reused with another dataset
        return samples

    def drained(self) -> list[list[Sample]]:
        """Every kept group, oldest first, taken out (for a data source to hold instead)."""
        groups = list(self._groups.values())
        self._groups.clear()
        return groups


def prepare_resumed(samples: list[Sample], mask_offpolicy: bool) -> None:
    """slime's --mask-offpolicy-in-partial-rollout: tokens an earlier rollout's policy generated leave the loss."""
    if not mask_offpolicy:
        return
    for sample in samples:
        sample.loss_mask = [0] * sample.response_length
