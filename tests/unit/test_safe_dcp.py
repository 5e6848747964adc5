"""Checkpoints cannot run code: DCP metadata through a restricted unpickler, RNG states with weights_only."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from services.common.errors import InvalidArgument
from services.trainer.checkpoint.safe_dcp import SafeFileSystemReader


class _Payload:
    """Unpickling this runs `open(marker, "w")`: what a crafted checkpoint would do."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def save(path, state) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=path, no_dist=True)


def load(path, state) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=SafeFileSystemReader(path), no_dist=True)


def test_a_real_checkpoint_loads_through_the_safe_reader(tmp_path):
    saved = {"model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(2, dtype=torch.bfloat16)},
             "optim": {"step": 3, "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.99)}]}}
    save(tmp_path / "dcp", saved)
    loaded = {"model": {"w": torch.zeros(3, 4), "b": torch.zeros(2, dtype=torch.bfloat16)},
              "optim": {"step": 0, "param_groups": [{"lr": 0.0, "betas": (0.0, 0.0)}]}}
    load(tmp_path / "dcp", loaded)
    assert torch.equal(loaded["model"]["w"], saved["model"]["w"]) and loaded["optim"]["step"] == 3
    assert set(SafeFileSystemReader(tmp_path / "dcp").read_metadata().state_dict_metadata) >= {"model.w", "model.b"}


def test_crafted_metadata_is_refused_without_running(tmp_path):
    save(tmp_path / "dcp", {"model": {"w": torch.zeros(2)}})
    marker = tmp_path / "pwned"
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
    with pytest.raises(InvalidArgument, match=r"unsafe or unreadable metadata \(global io.open is not part"):
        SafeFileSystemReader(tmp_path / "dcp").read_metadata()  # what load_state reads first
    with pytest.raises(CheckpointException, match="global io.open is not part of checkpoint metadata"):
        load(tmp_path / "dcp", {"model": {"w": torch.zeros(2)}})  # DCP wraps the refusal in its own exception
    assert not marker.exists()


def test_rng_state_files_load_only_as_weights(tmp_path):
    marker = tmp_path / "pwned"
    torch.save({"python": _Payload(str(marker))}, tmp_path / "rng_rank0.pt")
    with pytest.raises(pickle.UnpicklingError):
        torch.load(tmp_path / "rng_rank0.pt", weights_only=True)
    assert not marker.exists()
