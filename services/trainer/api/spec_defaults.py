"""The trainer's defaults for submitted job specs: the deployment's choices (e.g. `train_backend: megatron` on a GPU
cluster) filled into the keys a spec leaves out, before it is validated. A spec that sets a key keeps its value."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from services.trainer.api.config import TrainerConfig
from services.trainer.api.spec import JobSpec, parse_spec
from services.trainer.api.spec_paths import PathRoots, confine_paths
from services.trainer.slime_flags import args as slime_args

SpecParser = Callable[[Any], JobSpec]


def spec_defaults(config: TrainerConfig) -> dict[str, Any]:
    """The spec keys this trainer fills in when a submitted spec lacks them."""
    return {"train_backend": config.default_train_backend,
            "weight_sync_backend": config.default_weight_sync_backend}


def path_roots(config: TrainerConfig) -> PathRoots:
    return PathRoots(data=tuple(config.data_roots), checkpoints=tuple(config.checkpoint_roots),
                     exports=tuple(config.export_roots))


def spec_parser(defaults: dict[str, Any], roots: PathRoots = PathRoots()) -> SpecParser:
    """parse_spec after filling in `defaults` (a spec that is not a mapping is parse_spec's to refuse), with its
    paths confined to `roots`."""

    def parse(data: Any) -> JobSpec:
        if isinstance(data, dict):  # slime_args carries slime's own defaults (train_backend megatron): first
            data = {**defaults, **slime_args.apply(data, set(JobSpec.model_fields))}
        spec = parse_spec(data)
        confine_paths(spec, roots)
        return spec

    return parse
