"""Training backends by their `train_backend` name: each backend module registers how it is built for a job, so
the driver neither imports a backend by name nor branches on one; what each can do is `capabilities.py`."""

from __future__ import annotations

from collections.abc import Callable

from services.common.errors import InvalidArgument
from services.trainer.backends.base import TrainBackend
from services.trainer.backends.capabilities import BACKENDS
from services.trainer.backends.layout import LayoutConfig
from services.trainer.distributed.parallel import World
from services.trainer.settings.train import TrainConfig

# (hf_checkpoint, training settings, layout, this rank's world, CPU threads) -> the backend on this rank
Builder = Callable[[str, TrainConfig, LayoutConfig, World, int], TrainBackend]
_BUILDERS: dict[str, Builder] = {}


def register(name: str) -> Callable[[Builder], Builder]:
    """Decorator: `builder` builds backend `name` (one whose capabilities `capabilities.BACKENDS` declares)."""
    if name not in BACKENDS:
        raise ValueError(f"backend {name!r}: declare its capabilities in capabilities.BACKENDS ({', '.join(BACKENDS)})")

    def add(builder: Builder) -> Builder:
        _BUILDERS[name] = builder
        return builder

    return add


def registered() -> tuple[str, ...]:
    return tuple(sorted(_BUILDERS))


def build_backend(hf_checkpoint: str, train: TrainConfig, layout: LayoutConfig, world: World,
                  num_threads: int) -> TrainBackend:
    builder = _BUILDERS.get(layout.train_backend)
    if builder is None:
        raise InvalidArgument(f"train_backend {layout.train_backend!r} is not available in this trainer (registered: "
                              f"{', '.join(registered()) or 'none'})")
    return builder(hf_checkpoint, train, layout, world, num_threads)
