"""What a training backend's state offers its checkpoints (`BackendState`): the checkpoint half of
`backends/base.py`'s `TrainBackend`, declared here so that the checkpoint code names no backend."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol


class BackendState(Protocol):
    """A backend's state as checkpoints see it: written and read in its own format, each rank its shards. Every
    method is collective: every rank of the job calls it."""

    checkpoint_format: str  # its state's format: dcp (in iter_N/dcp/), torch_dist (Megatron-LM's, in iter_N/ itself)

    def load_teacher_sharded(self, path: str | Path) -> None:
        """The policy of a checkpoint's state directory as the teacher."""
        ...

    def load_megatron_checkpoint(self, path: str | Path, into: str) -> None:
        """The model weights of a slime (Megatron-LM) torch_dist directory (release/ or iter_N/) into the policy
        ("model", a fresh optimizer), the reference ("ref_model") or the distillation teacher ("teacher")."""
        ...

    def checkpoint_parts(self) -> set[str]:
        """The parts a checkpoint of this backend holds (model, optim, ref_model, ...)."""
        ...

    def save_sharded(self, path: str | Path, rollout_id: int = 0) -> None:
        """Write its state, the checkpoint of rollout `rollout_id`, into `path` (`iterations.state_dir`), each rank
        its shards."""
        ...

    def load_sharded(self, path: str | Path, parts: set[str] | None = None) -> set[str]:
        """Load the parts (default: all) a checkpoint's state directory has; returns the parts loaded."""
        ...

    def load_ref_sharded(self, path: str | Path) -> None:
        """The policy of a checkpoint's state directory as the reference model."""
        ...
