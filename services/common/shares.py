"""A trainer rank's share of a rollout, decided one way wherever it is decided: by the buffer, which serves each rank
its own groups, and by the trainer replaying a rollout dump. slime's data-parallel split, done at the source.

The rollout's groups, in group_id order, are cut into optimizer steps of `step_groups` groups; each step's groups
are dealt to `count` shares of equal size (whole groups: the group estimators need every sibling), the group with
the most tokens first, each to the share with the fewest tokens so far, so no rank's long tail stalls the others.
Equal group counts keep each rank's step the same number of samples, which the loss normalization assumes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.common.errors import InvalidArgument


@dataclass(frozen=True)
class Share:
    """Share `index` of `count`, over steps of `step_groups` groups (0: the rollout is one step)."""

    index: int = 0
    count: int = 1
    step_groups: int = 0

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.index < self.count:
            raise InvalidArgument(f"share: index {self.index} of count {self.count} (need 0 <= index < count)")
        if self.step_groups < 0 or (self.count > 1 and self.step_groups % self.count):
            raise InvalidArgument(f"share: step_groups ({self.step_groups}) must be a multiple of the share count "
                                  f"({self.count}): each rank trains an equal share of whole groups of every step")

    @property
    def whole(self) -> bool:
        return self.count == 1


def share_positions(group_ids: Sequence[str], num_tokens: Sequence[int], share: Share) -> list[int]:
    """The positions (into group_ids) of `share`'s groups, in group_id order. One share of one is every group;
    otherwise groups that fill no step are left out (as one process leaves them out of its steps)."""
    order = sorted(range(len(group_ids)), key=group_ids.__getitem__)
    if share.whole:
        return order
    step = share.step_groups or len(order) - len(order) % share.count
    per_share = step // share.count
    mine: list[int] = []
    for start in range(0, len(order) - step + 1, step) if step else ():
        members = order[start:start + step]
        loads, sizes, owner = [0] * share.count, [0] * share.count, {}
        for rank_in_step, pos in sorted(enumerate(members), key=lambda m: (-num_tokens[m[1]], m[0])):
            k = min((k for k in range(share.count) if sizes[k] < per_share), key=lambda k: (loads[k], k))
            loads[k] += num_tokens[pos]
            sizes[k] += 1
            owner[rank_in_step] = k
        mine.extend(pos for rank_in_step, pos in enumerate(members) if owner[rank_in_step] == share.index)
    return mine
