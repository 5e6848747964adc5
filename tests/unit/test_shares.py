"""A rollout's shares among trainer ranks (services.common.shares): whole groups, equal counts per step, balanced by
tokens, the same answer wherever it is computed."""

import pytest

from services.common.errors import InvalidArgument
from services.common.shares import Share, share_positions

IDS = [f"job:0:{i}" for i in range(9)]


def test_each_step_is_dealt_by_tokens_into_equal_counts_of_whole_groups():
    # step 1 (groups 0-3): 100, 90, 10, 20 tokens. Largest first, each to the lighter share with room:
    # 0 -> A, 1 -> B, 3 (20) -> B (90 < 100), 2 (10) -> A (B is full): A = {0, 2} = 110, B = {1, 3} = 110,
    # where cutting the step in halves gives 190 against 30. Step 2 (groups 4-7) is all equal: 4 -> A, 5 -> B,
    # 6 -> A, 7 -> B (ties go to the lower share). Group 8 fills no step and is left out.
    tokens = [100, 90, 10, 20, 5, 5, 5, 5, 7]
    shares = [share_positions(IDS, tokens, Share(index=k, count=2, step_groups=4)) for k in range(2)]
    assert shares == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert [sum(tokens[i] for i in share[:2]) for share in shares] == [110, 110]


def test_positions_follow_group_id_order_not_the_order_given():
    ids = ["job:0:3", "job:0:1", "job:0:2", "job:0:0"]  # as written: positions 3, 1, 2, 0 in group_id order
    assert share_positions(ids, [1, 1, 1, 1], Share()) == [3, 1, 2, 0]
    assert share_positions(ids, [1, 1, 1, 1], Share(index=1, count=2, step_groups=4)) == [1, 0]  # job:0:1, :3


def test_one_share_is_the_whole_rollout_and_bad_shares_are_refused():
    assert share_positions(IDS, [1] * 9, Share(count=1, step_groups=4)) == list(range(9))
    with pytest.raises(InvalidArgument, match=r"step_groups \(6\) must be a multiple of the share count \(4\)"):
        Share(index=0, count=4, step_groups=6)
    with pytest.raises(InvalidArgument, match="index 2 of count 2"):
        Share(index=2, count=2)
