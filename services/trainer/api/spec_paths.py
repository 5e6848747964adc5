"""Confine a job spec's paths to the directories the operator configured for the trainer.

Reads (model, data, checkpoints to load, rollout dumps) must lie under one of the data, checkpoint or export roots;
checkpoints are written under the checkpoint roots, exports and dumps under the export roots. Each path is
normalised first (`..` collapsed, symlinks resolved); "{rollout_id}" templates are checked with a rollout id filled
in. Empty roots leave that kind unconfined (local runs). What the paths hold is left to the loop.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from services.common.paths import confine
from services.trainer.api.spec import JobSpec

READS = ("hf_checkpoint", "load", "ref_load", "load_debug_rollout_data")
CHECKPOINT_WRITES = ("save", "update_weight_disk_dir")  # the disk dir: published weights, cleared at start
EXPORT_WRITES = ("save_hf", "save_debug_rollout_data")
_ROW_SLICE = re.compile(r"@\[-?\d*:-?\d*\]$")  # the buffer's "path@[start:end]" row selection


@dataclass(frozen=True)
class PathRoots:
    data: tuple[str, ...] = ()
    checkpoints: tuple[str, ...] = ()
    exports: tuple[str, ...] = ()

    @property
    def readable(self) -> tuple[str, ...]:
        """Any root may be read, unless one kind is unconfined (then reads are too)."""
        return (*self.data, *self.checkpoints, *self.exports) if self.data and self.checkpoints else ()


def confine_paths(spec: JobSpec, roots: PathRoots) -> None:
    """InvalidArgument naming the key of the first path outside its roots."""
    datasets = [spec.prompt_data, *(entry.split("=", 1)[1] for entry in spec.eval_prompt_data if "=" in entry)]
    for path in datasets:
        confine(_ROW_SLICE.sub("", path), roots.data, "job spec: prompt_data/eval_prompt_data")
    for key, allowed in [*((k, roots.readable) for k in READS), *((k, roots.checkpoints) for k in CHECKPOINT_WRITES),
                         *((k, roots.exports) for k in EXPORT_WRITES)]:
        value = getattr(spec, key)
        if value:
            confine(value.replace("{rollout_id}", "0"), allowed, f"job spec: {key}")
