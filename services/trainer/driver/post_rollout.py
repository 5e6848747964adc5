"""The trainer's side of the rollout manager's generation features (issue 5): the manager's per-rollout counters
(rollout/dynamic_filter/drop_<reason>) and eval at eval_interval, for the job's events.

Eval runs like slime's periodic action: after every eval_interval-th rollout and after the last one, once the engines
hold the new weights.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from services.common.errors import InvalidArgument, PhysarumError
from services.trainer.spec import JobSpec
from services.trainer.train_config import rollout_config

if TYPE_CHECKING:
    from services.trainer.driver.loop import TrainerDeps

log = logging.getLogger(__name__)

MANAGER_METRICS = ("rollout/dynamic_filter/",)  # the manager's counters the trainer cannot compute from samples


def eval_due(spec: JobSpec, rollout_id: int) -> bool:
    if not spec.eval_prompt_data or spec.eval_interval is None:
        return False
    return (rollout_id + 1) % spec.eval_interval == 0 or rollout_id == spec.num_rollout - 1


def generation_metrics(spec: JobSpec, deps: TrainerDeps, rollout_id: int) -> dict[str, float]:
    """Rank 0, after the weight sync of rollout `rollout_id`: the manager's counters, and eval/* when due.

    A bad eval dataset fails the job; an eval the manager could not finish (engines down, timeout) is logged and
    skipped, so a long run does not die of it.
    """
    status = deps.rollout.rollout_status(spec.job_id, rollout_id)
    metrics = {k: v for k, v in status.metrics.items() if k.startswith(MANAGER_METRICS)}
    if eval_due(spec, rollout_id):
        start = time.monotonic()
        try:
            metrics.update(deps.rollout.run_eval(rollout_config(spec), rollout_id, str(rollout_id + 1),
                                                 timeout_s=spec.rollout_timeout_s))
        except InvalidArgument:
            raise
        except PhysarumError as err:
            log.warning("job %s: eval after rollout %d failed, skipped: %s", spec.job_id, rollout_id, err)
        metrics["perf/eval_seconds"] = time.monotonic() - start
    return metrics
