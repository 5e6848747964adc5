"""Training backends behind one Protocol (`base.TrainBackend`): `fsdp.TorchBackend` (torch, one process) for now.

Import a backend's module directly; importing this package loads neither torch nor transformers.
"""

from services.trainer.backends.base import TrainBackend, TrainConfig

__all__ = ["TrainBackend", "TrainConfig"]
