"""The one-copy safetensors writer (the trainer's) and reader (the engine's) agree with the safetensors package, byte
for byte in content."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.engine import safetensors_io as reader
from services.trainer.checkpoint import safetensors_io as writer


def sample() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"w": torch.randn(3, 5, generator=gen), "b16": torch.randn(7, generator=gen).to(torch.bfloat16),
            "ids": torch.arange(6, dtype=torch.int64).reshape(2, 3), "scalar": torch.tensor(2.5),
            "empty": torch.zeros(0, 4), "mask": torch.tensor([True, False, True])}


def test_written_file_loads_with_safetensors(tmp_path):
    tensors = sample()
    path = tmp_path / "model.safetensors"
    written = writer.write(path, tensors.items(), metadata={"weight_version": "7"})
    assert written == sum(t.numel() * t.element_size() for t in tensors.values())
    loaded = load_file(str(path))
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name


def test_read_into_fills_targets_from_a_safetensors_file(tmp_path):
    tensors = sample()
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    entries, _ = reader.read_header(path)
    assert {name: (dtype, shape) for name, (dtype, shape, _, _) in entries.items()} == {
        name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}
    targets = {name: torch.full_like(t, 1) if t.numel() else torch.empty_like(t) for name, t in tensors.items()}
    reader.read_into(path, targets)
    for name, tensor in tensors.items():
        assert torch.equal(targets[name], tensor), name


def test_read_into_refuses_a_target_of_another_shape(tmp_path):
    path = tmp_path / "model.safetensors"
    writer.write(path, [("w", torch.ones(2, 3))])
    with pytest.raises(ValueError, match="'w' is torch.float32 \\[2, 3\\], the target is torch.float32 \\[3, 2\\]"):
        reader.read_into(path, {"w": torch.empty(3, 2)})


def test_write_refuses_a_non_contiguous_tensor(tmp_path):
    with pytest.raises(ValueError, match="'t': write takes contiguous CPU tensors"):
        writer.write(tmp_path / "x.safetensors", [("t", torch.ones(3, 4).t())])


def test_read_header_names_a_file_that_is_not_safetensors(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{oops")
    with pytest.raises(ValueError, match="model.safetensors: not a safetensors file this reader knows"):
        reader.read_header(path)
