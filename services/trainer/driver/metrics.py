"""Where a job's step metrics go besides its events: Prometheus gauges and TensorBoard event files.

Gauges are `physarum_trainer_<section>_<name>` (`train/pg_loss` -> physarum_trainer_train_pg_loss) with one label,
`job`: they hold the latest values of the job that runs (or ran last), so a dashboard names what it plots. One job's
series at a time: a new job's writer removes the previous job's. Counters take labels from small fixed sets only.
TensorBoard writes `section/name` scalars at step = rollout id (torch.utils.tensorboard, when installed).
"""

from __future__ import annotations

import logging
import re
import threading
from pathlib import Path
from typing import Any

from prometheus_client import Counter, Gauge

log = logging.getLogger(__name__)

PREFIX = "physarum_trainer_"
_gauges: dict[str, Gauge] = {}
_lock = threading.Lock()

ROLLOUTS = Counter(f"{PREFIX}rollouts", "rollouts trained on (or generated, under debug_rollout_only)")
CHECKPOINTS = Counter(f"{PREFIX}checkpoints", "checkpoints saved")
ROLLOUT_ID = Gauge(f"{PREFIX}rollout_id", "the running job's last finished rollout id", ["job"])


def prometheus_name(key: str) -> str:
    """`train/pg_loss` -> `physarum_trainer_train_pg_loss` (anything but [a-zA-Z0-9_] becomes `_`)."""
    return PREFIX + re.sub(r"[^a-zA-Z0-9_]", "_", key).strip("_").lower()


def set_gauges(metrics: dict[str, float], job: str = "") -> None:
    for key, value in metrics.items():
        name = prometheus_name(key)
        with _lock:
            gauge = _gauges.get(name)
            if gauge is None:
                gauge = _gauges[name] = Gauge(name, f"the running job's latest {key}", ["job"])
        gauge.labels(job).set(value)


def clear_gauges() -> None:
    """Drop every job's gauge series: a new job starts, and the gauges describe one job at a time."""
    with _lock:
        gauges = [*_gauges.values(), ROLLOUT_ID]
    for gauge in gauges:
        gauge.clear()


class MetricsWriter:
    """One job's metrics sink (rank 0): Prometheus gauges always, TensorBoard when `tensorboard_dir` is set, W&B
    when the job has use_wandb."""

    def __init__(self, tensorboard_dir: str | Path | None = None, wandb_run: Any = None, job_id: str = "") -> None:
        self.wandb_run = wandb_run  # driver/wandb_log.py's WandbRun, when the job uses W&B
        self.job_id = job_id
        clear_gauges()
        self.writer = None
        if tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as err:  # the tensorboard package is optional
                log.warning("no TensorBoard event files (%s): install the `tensorboard` package", err)
            else:
                try:
                    self.writer = SummaryWriter(log_dir=str(tensorboard_dir))
                    log.info("TensorBoard event files in %s", tensorboard_dir)
                except OSError as err:  # best effort: the job goes on without them
                    log.warning("no TensorBoard event files in %s: %s", tensorboard_dir, err)

    def write(self, rollout_id: int, metrics: dict[str, float]) -> None:
        set_gauges(metrics, self.job_id)
        ROLLOUT_ID.labels(self.job_id).set(rollout_id)
        ROLLOUTS.inc()
        if self.wandb_run is not None:
            try:
                self.wandb_run.log(rollout_id, metrics)
            except Exception as err:  # noqa: BLE001 - best effort, like the event files
                log.warning("W&B: %s; no more W&B logging for this job", err)
                self.wandb_run = None
        if self.writer is not None:
            try:
                for key, value in metrics.items():
                    self.writer.add_scalar(key, value, global_step=rollout_id)
                self.writer.flush()
            except OSError as err:
                log.warning("TensorBoard event files: %s; no more of them for this job", err)
                self.writer = None

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.wandb_run is not None:
            self.wandb_run.close()
