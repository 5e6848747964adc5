"""W&B logging with slime's flags and metric names (use_wandb, wandb_mode/project/group/team/host/key/dir/run_id):
the job's metrics go to one run, beside the TensorBoard files, with slime's step metrics (rollout/step,
train/step, eval/step = the rollout id here: the trainer logs once per rollout). Offline mode needs no network.
"""

from __future__ import annotations

import logging
import os
import random
import string
from typing import Any

from services.common.errors import InvalidArgument

log = logging.getLogger(__name__)
_SECTIONS = {"train": "train/step", "rollout": "rollout/step", "multi_turn": "rollout/step",
             "passrate": "rollout/step", "perf": "rollout/step", "eval": "eval/step"}
_SECRET = ("wandb_key",)


class WandbRun:
    """One job's W&B run (rank 0)."""

    def __init__(self, run: Any, always_train_step: bool) -> None:
        self.run = run
        self.always_train_step = always_train_step

    def log(self, rollout_id: int, metrics: dict[str, float]) -> None:
        steps = {"train/step": rollout_id} if self.always_train_step else \
            {step: rollout_id for key in metrics if (step := _SECTIONS.get(key.split("/", 1)[0]))}
        self.run.log({**metrics, **steps})

    def close(self) -> None:
        self.run.finish()


def start(spec: Any, config: dict[str, Any]) -> WandbRun | None:
    """The job's run when spec.use_wandb (spec: the DriverConfig), as slime's init_wandb_primary makes it, logging
    `config` (the job's args) as the run's config; None otherwise."""
    if not spec.use_wandb:
        return None
    try:
        import wandb
    except ImportError as err:
        raise InvalidArgument("use_wandb needs the wandb package (part of the trainer's install: "
                              "pip install 'physarum[trainer]')") from err
    mode = spec.wandb_mode or os.environ.get("WANDB_MODE") or "online"
    if mode == "online" and spec.wandb_key:
        wandb.login(key=spec.wandb_key, host=spec.wandb_host)
    group = spec.wandb_group or spec.job_id
    name = group
    if not spec.disable_wandb_random_suffix:  # slime's: group_<random>, run group_<random>-RANK_0
        group = f"{group}_{''.join(random.choices(string.ascii_lowercase + string.digits, k=8))}"
        name = f"{group}-RANK_0"
    if spec.wandb_dir:
        os.makedirs(spec.wandb_dir, exist_ok=True)
    config = {k: v for k, v in config.items() if k not in _SECRET}
    run = wandb.init(entity=spec.wandb_team, project=spec.wandb_project, group=group, name=name, config=config,
                     dir=spec.wandb_dir or None, id=spec.wandb_run_id, resume="allow" if spec.wandb_run_id else None,
                     settings=wandb.Settings(mode=mode, console="off", x_disable_stats=True))
    for step in ("train/step", "rollout/step", "eval/step"):
        run.define_metric(step)
    for section, step in _SECTIONS.items():
        run.define_metric(f"{section}/*", step_metric=step)
    log.info("W&B run %s (%s mode)", run.id, mode)
    return WandbRun(run, spec.wandb_always_use_train_step)
