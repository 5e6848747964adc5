"""What rank 0 asks the rollout manager after each rollout: its counters the trainer cannot compute from samples
(rollout/dynamic_filter/drop_<reason>, a rollout function's rollout/function/*) and, when due, an eval, for the
job's events. The mode's driver calls both (`job_run.JobRun`).

Eval runs like slime's periodic action: after every eval_interval-th rollout and after the last one, once the engines
hold the new weights.
"""

from __future__ import annotations

import logging
import time

from services.common.errors import InvalidArgument, PhysarumError
from services.common.settings.rollout import RolloutConfig
from services.trainer.driver.deps import TrainerDeps
from services.trainer.driver.intervals import should_run_periodic_action
from services.trainer.settings.driver import DriverConfig

log = logging.getLogger(__name__)

# the manager's counters the trainer cannot compute from samples, and a rollout function's own metrics
MANAGER_METRICS = ("rollout/dynamic_filter/", "rollout/function/")


def eval_due(driver: DriverConfig, rollout: RolloutConfig, rollout_id: int) -> bool:
    return bool(rollout.eval_prompt_data) and should_run_periodic_action(rollout_id, driver.eval_interval,
                                                                        num_rollout=driver.num_rollout)


def manager_metrics(driver: DriverConfig, deps: TrainerDeps, rollout_id: int) -> dict[str, float]:
    """Rank 0, after rollout `rollout_id`: the manager's counters the trainer cannot compute from samples."""
    status = deps.rollout.rollout_status(driver.job_id, rollout_id)
    return {k: v for k, v in status.metrics.items() if k.startswith(MANAGER_METRICS)}


def evaluate(driver: DriverConfig, rollout: RolloutConfig, deps: TrainerDeps, rollout_id: int) -> dict[str, float]:
    """Rank 0, after the weight sync of rollout `rollout_id`: eval/* from the manager, with the weights pushed after
    it (version rollout_id + 1).

    A bad eval dataset fails the job; an eval the manager could not finish (engines down, timeout) is logged and
    skipped, so a long run does not die of it.
    """
    start = time.monotonic()
    metrics: dict[str, float] = {}
    try:
        metrics.update(deps.rollout.run_eval(rollout, rollout_id, str(rollout_id + 1),
                                             timeout_s=driver.rollout_timeout_s))
    except InvalidArgument:
        raise
    except PhysarumError as err:
        log.warning("job %s: eval after rollout %d failed, skipped: %s", driver.job_id, rollout_id, err)
    metrics["perf/eval_seconds"] = time.monotonic() - start
    return metrics
