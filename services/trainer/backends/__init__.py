"""Training backends behind one Protocol (`base.TrainBackend`): `fsdp.TorchBackend` (torch FSDP2) and
`megatron.backend.MegatronBackend` (megatron-core), each registering its builder with `registry`; `layout.py` holds
which backend a job uses and how its ranks are laid out.

Importing this package loads neither torch nor transformers.
"""

from services.trainer.backends.base import TrainBackend, TrainConfig

__all__ = ["TrainBackend", "TrainConfig"]
