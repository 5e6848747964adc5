"""Checkpoints of a backend whose state is torch state dicts (the torch backend), in torch.distributed.checkpoint's
format: each rank writes its own shards, and a load reshards to any number of ranks.

`DCPCheckpointing` gives such a backend the checkpoint half of `TrainBackend` from its `state_dict(parts)` and
`load_state_dict(state)`; the checkpoint layout around it (iter_N/, RNG, trainer state) is checkpoint/iterations.py's.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp

from services.common.errors import InvalidArgument
from services.trainer.checkpoint.safe_dcp import SafeFileSystemReader
from services.trainer.distributed.parallel import World


class DCPCheckpointing:
    """Mixin: `save_sharded`, `load_sharded`, `load_ref_sharded` for a backend with `world`, `state_dict(parts)`
    and `load_state_dict(state)`."""

    checkpoint_format = "dcp"  # the directory of the state inside iter_N/
    world: World

    def state_dict(self, parts: Iterable[str] | None = None) -> dict[str, Any]:
        raise NotImplementedError

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def checkpoint_parts(self) -> set[str]:
        """The parts a checkpoint of this backend holds now (an optimizer only once it has stepped)."""
        return set(self.state_dict())

    def save_sharded(self, path: str | Path, rollout_id: int = 0) -> None:
        with _one_process_is_intended():
            dcp.save(self.state_dict(), checkpoint_id=Path(path), no_dist=not self.world.distributed)

    def load_sharded(self, path: str | Path, parts: set[str] | None = None) -> set[str]:
        """Load the parts both the checkpoint and `parts` (default: all) name; returns those loaded."""
        try:
            saved = {key.split(".", 1)[0] for key in SafeFileSystemReader(path).read_metadata().state_dict_metadata}
        except FileNotFoundError:
            raise InvalidArgument(f"checkpoint {path}: no torch.distributed.checkpoint metadata") from None
        wanted = saved if parts is None else saved & set(parts)
        state = self.state_dict(parts=wanted)
        with _one_process_is_intended():
            dcp.load(state, storage_reader=SafeFileSystemReader(Path(path)), no_dist=not self.world.distributed)
        self.load_state_dict(state)
        return wanted

    def load_ref_sharded(self, path: str | Path) -> None:
        """The policy of a checkpoint as the reference model (slime's --ref-load of a checkpoint)."""
        state = {"model": self.state_dict(parts=("ref_model",))["ref_model"]}
        with _one_process_is_intended():
            dcp.load(state, storage_reader=SafeFileSystemReader(Path(path)), no_dist=not self.world.distributed)
        self.load_state_dict({"ref_model": state["model"]})

    def _load_policy_into(self, model: Any, path: str | Path) -> None:
        """The policy ("model") of a checkpoint into another module of the same architecture (a frozen copy)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

        state = {"model": get_model_state_dict(model)}
        with _one_process_is_intended():
            dcp.load(state, storage_reader=SafeFileSystemReader(Path(path)), no_dist=not self.world.distributed)
        set_model_state_dict(model, state["model"])


@contextlib.contextmanager
def _one_process_is_intended() -> Iterator[None]:
    """DCP warns that it assumes one process whenever no process group exists: that is the single-rank trainer."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
