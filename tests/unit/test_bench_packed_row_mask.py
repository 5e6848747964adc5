"""bench/packed_row_mask.py: the mask transformers makes for a packed row is the block-diagonal causal one, of T²
bytes, outside `varlen.packed_row` and none inside it; the JSON line holds the keys its docstring names."""

from __future__ import annotations

import pytest
import torch

from bench import packed_row_mask
from services.trainer.batching import varlen


def test_the_mask_built_is_the_rows_block_causal_one_and_none_is_built_under_packed_row():
    config = packed_row_mask.mask_model().config
    mask = packed_row_mask.make_mask(config, 20, torch.device("cpu"))
    # eight sequences: seven of 20 // 8 = 2 tokens and the last of the 6 left
    cu_seqlens = torch.tensor([0, 2, 4, 6, 8, 10, 12, 14, 20])
    assert mask.shape == (1, 1, 20, 20) and torch.equal(mask[0, 0], varlen.block_causal_mask(cu_seqlens, 20))
    with varlen.packed_row():
        assert packed_row_mask.make_mask(config, 20, torch.device("cpu")) is None


def test_the_bench_reads_the_masks_bytes_and_the_memory_held_making_it():
    result = packed_row_mask.main(["--sizes", "2048", "--device", "cpu"])
    assert result["held_mib"] == {"built_2k": 4.0, "skipped_2k": 0.0}  # 2,048² one-byte pairs
    # at least the mask itself while it is made; nothing of that size when it is skipped
    assert result["peak_mib"]["built_2k"] >= 4.0 > 4 * result["peak_mib"]["skipped_2k"]
    for key in ("device", "peak_mib", "held_mib", "built_8k", "skipped_8k"):
        assert f'"{key}"' in packed_row_mask.__doc__, key


def test_a_row_shorter_than_its_sequences_is_refused():
    with pytest.raises(SystemExit):
        packed_row_mask.main(["--sizes", "4"])
