"""The engine's prefix index: cached_tokens as SGLang's radix cache reports them (the longest computed prefix, the
prompt's last token never), per weight version, bounded."""

from __future__ import annotations

import pytest

from services.engine.prefix_cache import PrefixIndex


def test_a_prompt_matches_the_longest_computed_prefix_but_never_its_last_token():
    index = PrefixIndex()
    assert index.match([1, 2, 3], "v0") == 0
    index.insert([1, 2, 3, 4, 5], "v0")
    index.insert([1, 2, 9], "v0")
    assert index.match([1, 2, 3, 4, 5, 6, 7], "v0") == 5  # a next turn: all the first one computed
    assert index.match([1, 2, 3, 4, 5], "v0") == 4  # the same prompt again: its last token is computed anew
    assert index.match([1, 2, 9, 9], "v0") == 3
    assert index.match([1, 7], "v0") == 1
    assert index.match([2, 1, 2, 3], "v0") == 0
    assert index.num_tokens == 6  # shared prefixes are held once


def test_new_weights_start_afresh_and_a_full_index_keeps_the_newest_sequence():
    index = PrefixIndex(max_tokens=4)
    index.insert([1, 2, 3], "v0")
    assert index.match([1, 2, 3, 4], "v1") == 0
    index.insert([1, 2, 3], "v1")
    index.insert([7, 8, 9], "v1")  # past 4 tokens: only this one is kept
    assert (index.match([1, 2, 3, 4], "v1"), index.match([7, 8, 9, 4], "v1")) == (0, 3)
    assert index.num_tokens == 3
    with pytest.raises(ValueError, match="max_tokens"):
        PrefixIndex(max_tokens=0)
