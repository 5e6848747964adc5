"""What the driver sees of a job: its settings cut into parts (`JobParts`, what the job API's JobSpec offers), its
controls on rank 0 (`JobControl`: report progress, notice a cancel), and the exceptions that end it early.

Declared here, below the job API, so the driver knows no registry, server or spec parser: the API hands it a spec
and a control that fit these shapes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from services.common.settings.rollout import RolloutConfig
    from services.trainer.backends.layout import LayoutConfig
    from services.trainer.settings.driver import DriverConfig
    from services.trainer.settings.train import TrainConfig
    from services.trainer.settings.weight_sync import SyncConfig


class JobCancelled(Exception):
    """Raised inside a running job when it is cancelled."""


class JobPreempted(JobCancelled):
    """Raised inside a running job when the trainer stops (SIGTERM): the job stays unfinished and resumes from its
    latest checkpoint at the trainer's next start."""


class RanksLost(Exception):
    """Raised on rank 0 when a collective between the trainer's ranks broke (a rank died, or stopped answering
    within dist_timeout_s): the job stays unfinished, like a job whose trainer died, and the trainer exits so that
    all its ranks start again together and resume it from its latest checkpoint."""


def preempted(err: BaseException) -> bool:
    """`err` ends a job because the trainer is stopping: JobPreempted on rank 0, the RankAborted that names it on
    the other ranks."""
    return isinstance(err, JobPreempted) or f"{JobPreempted.__name__}:" in str(err)


class JobControl(Protocol):
    """A running job's line to whoever runs it (rank 0 only)."""

    def report(self, rollout_id: int, metrics: dict[str, float], message: str = "") -> None: ...

    def has_metrics(self, rollout_id: int) -> bool:
        """Whether rollout `rollout_id`'s metrics were reported (a resumed job reports its checkpoint's otherwise)."""

    def check_cancelled(self) -> None:
        """Raises JobCancelled (JobPreempted when the trainer is stopping) once the job should end."""


class JobParts(Protocol):
    """A job's settings as the parts the driver, the backend and the weight sync take."""

    hf_checkpoint: str

    @property
    def driver(self) -> DriverConfig: ...

    @property
    def rollout(self) -> RolloutConfig: ...

    @property
    def train(self) -> TrainConfig: ...

    @property
    def layout(self) -> LayoutConfig: ...

    @property
    def sync(self) -> SyncConfig: ...


def shared_base_key(spec: JobParts) -> tuple:
    """What LoRA jobs sharing one base model in the trainer (lora_share_pool) must agree on: the model, the backend,
    the layers that carry adapters, the compute dtype, and the engines' server options (slime's `sglang_*`: other
    ones would have the pool relaunch its engines under the running jobs)."""
    train = spec.train
    engine_options = tuple(sorted((key, repr(value)) for key, value in spec.rollout.args.items()
                                  if key.startswith("sglang_") and value is not None))
    return (spec.hf_checkpoint, spec.layout.train_backend, tuple(sorted(train.target_modules)), train.bf16,
            engine_options)
