"""Training backends by their `train_backend` name: each backend is the package of that name under `backends/`, which
registers how it is built for a job when imported. The registry imports it by its name when a job asks for it, so the
driver neither imports a backend nor branches on one; what each can do is `capabilities.py`."""

from __future__ import annotations

import importlib
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


def _import(name: str) -> None:
    """Import backend `name`'s package, which registers its builder (a package this trainer lacks registers none)."""
    package = f"{__package__}.{name}"
    try:
        importlib.import_module(package)
    except ModuleNotFoundError as err:
        if err.name != package:
            raise


def registered() -> tuple[str, ...]:
    """The backends this trainer can build: every declared one whose package registers a builder."""
    for name in BACKENDS:
        _import(name)
    return tuple(sorted(_BUILDERS))


def build_backend(hf_checkpoint: str, train: TrainConfig, layout: LayoutConfig, world: World,
                  num_threads: int, base_model=None) -> TrainBackend:
    """The backend of `layout.train_backend` on this rank; with `base_model` (a LoRA job joining a shared base,
    fsdp only) on that loaded model instead of a fresh copy of hf_checkpoint."""
    if layout.train_backend in BACKENDS:
        _import(layout.train_backend)
    builder = _BUILDERS.get(layout.train_backend)
    if builder is None:
        raise InvalidArgument(f"train_backend {layout.train_backend!r} is not available in this trainer (registered: "
                              f"{', '.join(registered()) or 'none'})")
    if base_model is not None:
        return builder(hf_checkpoint, train, layout, world, num_threads, base_model=base_model)
    return builder(hf_checkpoint, train, layout, world, num_threads)
