"""The delta codec and the trainer's delta base: payloads against hand-made bits, exactness over a sequence of
steps in bf16, and corrupted payloads caught by the checksum with the tensor left as it was."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.common import weight_delta
from services.common.errors import FailedPrecondition
from services.engine.delta import apply_blob
from services.trainer.settings.weight_sync import DeltaSettings
from services.trainer.weight_sync.delta import DeltaTracker, bits, served


def test_xor_payload_is_the_xor_of_the_bits():
    old, new = np.array([1, 2, 3, 4], np.uint16), np.array([1, 7, 3, 4], np.uint16)
    payload, num_changed, compressed = weight_delta.encode(old, new, "xor")
    assert (num_changed, compressed) == (1, False)  # 8 bytes do not shrink under zstd
    assert np.frombuffer(payload, np.uint16).tolist() == [0, 2 ^ 7, 0, 0]


def test_overwrite_payload_is_gaps_then_values():
    old, new = np.array([1, 2, 3, 4, 5], np.uint16), np.array([1, 7, 3, 4, 9], np.uint16)
    payload, num_changed, _ = weight_delta.encode(old, new, "overwrite")
    assert num_changed == 2
    assert np.frombuffer(payload, np.uint32, count=2).tolist() == [2, 3]  # positions 1 and 4, from -1
    assert np.frombuffer(payload, np.uint16, offset=8).tolist() == [7, 9]


def test_unchanged_tensor_has_no_payload():
    same = np.arange(10, dtype=np.uint16)
    assert weight_delta.encode(same, same.copy(), "xor") is None


@pytest.mark.parametrize("encoding", weight_delta.ENCODINGS)
@pytest.mark.parametrize("checksum", weight_delta.CHECKSUMS)
def test_apply_restores_new_bits_and_mostly_zero_deltas_compress(encoding, checksum):
    gen = np.random.default_rng(0)
    old = gen.integers(0, 1 << 16, 100_000, dtype=np.uint16)
    new = old.copy()
    new[gen.choice(old.size, 500, replace=False)] ^= 1
    payload, num_changed, compressed = weight_delta.encode(old, new, encoding)
    assert num_changed == 500 and compressed and len(payload) < old.nbytes // 20
    entry = weight_delta.Entry("w", "bfloat16", [old.size], encoding, compressed, num_changed,
                               weight_delta.checksum(new, checksum))
    target = old.copy()
    weight_delta.apply(target, entry, memoryview(payload), checksum)
    assert np.array_equal(target, new)


@pytest.mark.parametrize("encoding", weight_delta.ENCODINGS)
def test_a_corrupted_payload_fails_its_checksum_and_leaves_the_tensor(encoding):
    old = np.arange(1000, dtype=np.uint16)
    new = old.copy()
    new[::7] += 1
    payload, num_changed, compressed = weight_delta.encode(old, new, encoding)
    entry = weight_delta.Entry("w", "bfloat16", [1000], encoding, compressed, num_changed,
                               weight_delta.checksum(new, "xxh3-128"))
    bad = bytearray(payload)
    bad[len(bad) // 2] ^= 0x10
    target = old.copy()
    with pytest.raises(weight_delta.ChecksumError, match="w: "):
        weight_delta.apply(target, entry, memoryview(bytes(bad)), "xxh3-128")
    assert np.array_equal(target, old)


def adamw_like_steps(weights: dict[str, torch.Tensor], steps: int, lr: float) -> list[dict[str, torch.Tensor]]:
    """fp32 master weights moved by about lr per element per step (a sign step, as Adam's first ones are)."""
    gen = torch.Generator().manual_seed(1)
    out, current = [], {k: v.clone() for k, v in weights.items()}
    for _ in range(steps):
        current = {k: v - lr * torch.sign(torch.randn(v.shape, generator=gen)) for k, v in current.items()}
        out.append(current)
    return out


@pytest.mark.parametrize("encoding", weight_delta.ENCODINGS)
def test_engine_side_equals_trainer_in_bf16_after_a_sequence_of_deltas(encoding):
    gen = torch.Generator().manual_seed(0)
    master = {"a.weight": 0.02 * torch.randn(64, 48, generator=gen), "b.bias": torch.ones(48),
              "c.weight": 0.02 * torch.randn(300, generator=gen)}
    tracker = DeltaTracker(DeltaSettings(encoding, "xxh3-128"))
    first = served(master.items(), torch.bfloat16)
    tracker.commit(first, "0")
    engine = {name: t.clone() for name, t in first}  # the engine's parameters, at version 0
    version, scratch = "0", np.empty(64 * 48 * 2, np.uint8)
    for step, weights in enumerate(adamw_like_steps(master, 6, lr=1e-4), start=1):
        copies = tracker.stage(weights.items(), torch.bfloat16)  # into the buffers of two versions ago
        if step == 4:  # a forgotten base (a failed sync): this version goes in full, deltas resume after it
            tracker.reset()
            engine = {name: t.clone() for name, t in copies}
        else:
            blob, stats = tracker.encode(copies, str(step))
            assert 0 < stats.changed_fraction < 1 and "b.bias" not in [e.name for e in weight_delta.unpack(blob)[1]]
            result = apply_blob(engine, blob, version, scratch if step % 2 else None)
            assert result.failed == [] and result.reply()["weight_version"] == str(step)
        tracker.commit(copies, str(step))
        version = str(step)
        want = served(weights.items(), torch.bfloat16)
        for name, tensor in want:
            assert np.array_equal(bits(engine[name]), bits(tensor)), name
            assert np.array_equal(bits(tracker.base[name]), bits(tensor)), name


def test_engine_refuses_a_delta_from_another_version_and_names_corrupt_tensors():
    base = {"w": torch.zeros(256, dtype=torch.bfloat16), "v": torch.zeros(256, dtype=torch.bfloat16)}
    tracker = DeltaTracker()
    tracker.commit(list(base.items()), "3")
    new = [("w", torch.full((256,), 0.5, dtype=torch.bfloat16)), ("v", torch.full((256,), 2.0, dtype=torch.bfloat16))]
    blob, _ = tracker.encode(new, "4")
    engine = {k: v.clone() for k, v in base.items()}
    with pytest.raises(FailedPrecondition, match="from version '3' to '4', but this engine holds '2'"):
        apply_blob(engine, blob, "2")
    _, entries, _ = weight_delta.unpack(blob)
    corrupt = next(e for e in entries if e.name == "v")
    start = len(blob) - len(weight_delta.unpack(blob)[2]) + corrupt.offset
    blob[start] ^= 0xFF
    result = apply_blob(engine, blob, "3")
    assert result.failed == ["v"] and result.applied == ["w"]
    assert result.reply()["weight_version"] == "3"  # not moved: v still needs its full copy
    assert torch.equal(engine["w"], new[0][1]) and torch.equal(engine["v"], base["v"])


def test_versions_that_cannot_name_files_are_refused():
    with pytest.raises(ValueError, match="cannot name a delta"):
        weight_delta.check_version("../x")
