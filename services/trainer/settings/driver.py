"""The driver's settings: the job's model and data, how many rollouts, the mode, the intervals, checkpoints and
debug dumps. The loop reads these; the parts it drives get their own configs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from services.common.config import NON_NEGATIVE, POSITIVE, REQUIRED, check_fields, field

Mode = Literal["sync", "one_step_async", "fully_async"]


@dataclass(frozen=True, kw_only=True)
class DriverConfig:
    job_id: str = field("", "the job's id (empty: one is generated)")
    hf_checkpoint: str = field(REQUIRED, "the HF model directory to start from (and the tokenizer)")
    prompt_data: str = field(REQUIRED, "the prompt dataset (JSONL or Parquet with slime's keys)")
    rollout_shuffle: bool = field(False, "shuffle the prompts every epoch")
    rollout_seed: int = field(42, "seed of the prompt shuffle")
    num_rollout: int = field(REQUIRED, "rollouts to train on", POSITIVE)
    mode: Mode = field("sync", "sync, one_step_async (rollout i+1 generates while rollout i trains) or fully_async "
                               "(the manager streams groups across rollouts; stale ones are refused)")
    update_weights_interval: int = field(1, "push weights to the engines every N rollouts (async modes)", POSITIVE)
    max_weight_staleness: int = field(1, "fully_async: a trained token's policy is at most this many versions old",
                                      NON_NEGATIVE)
    stale_policy: Literal["regenerate", "drop"] = field("regenerate", "a too-stale group: regenerated, or dropped")
    save: str = field("", "checkpoint root: iter_{rollout_id:07d}/ + latest_checkpointed_iteration.txt (a job with "
                          "save always saves at its end)")
    save_interval: int | None = field(None, "also save every N rollouts", POSITIVE)
    load: str = field("", "resume from this checkpoint root (an HF directory: its weights only)")
    ckpt_step: int | None = field(None, "the rollout id to load instead of the latest one", NON_NEGATIVE)
    ref_load: str = field("", "the reference model: an HF directory or a checkpoint root (Physarum's or slime's "
                              "torch_dist)")
    ref_ckpt_step: int | None = field(None, "the rollout id of ref_load's checkpoint to load instead of its latest",
                                      NON_NEGATIVE)
    opd_teacher_load: str = field("", "on-policy distillation's teacher model (use_opd, opd_type megatron): an HF "
                                      "directory or a checkpoint root, of the policy's architecture")
    opd_teacher_ckpt_step: int | None = field(None, "the rollout id of opd_teacher_load's checkpoint to load instead "
                                                    "of its latest", NON_NEGATIVE)
    ref_update_interval: int | None = field(None, "copy the policy into the reference model every N rollouts",
                                            POSITIVE)
    eval_interval: int | None = field(None, "eval every N rollouts and after the last one", POSITIVE)
    save_hf: str = field("", "export the final model here (\"{rollout_id}\" is filled in)")
    save_debug_rollout_data: str = field("", "dump each rollout's samples (\"{rollout_id}\" is filled in)")
    load_debug_rollout_data: str = field("", "train on dumps instead of engines (implies debug_train_only)")
    debug_rollout_only: bool = field(False, "generate rollouts, train nothing")
    debug_train_only: bool = field(False, "no engines, no buffer: needs load_debug_rollout_data")
    rollout_timeout_s: float = field(600.0, "seconds a rollout (or an eval) may take", POSITIVE)
    # W&B, with slime's flags (driver/wandb_log.py)
    use_wandb: bool = field(False, "log the job's metrics to W&B too, beside the TensorBoard files")
    wandb_mode: Literal["", "online", "offline", "disabled"] = field("", "W&B mode (empty: WANDB_MODE, else online)")
    wandb_project: str | None = field(None, "W&B project")
    wandb_group: str | None = field(None, "W&B group (None: the job id)")
    wandb_team: str | None = field(None, "W&B entity")
    wandb_host: str | None = field(None, "W&B server (online mode)")
    wandb_key: str | None = field(None, "W&B API key (online mode; never logged)")
    wandb_dir: str | None = field(None, "directory of the W&B run files")
    wandb_run_id: str | None = field(None, "resume this W&B run")
    wandb_always_use_train_step: bool = field(False, "every metric's step is train/step")
    disable_wandb_random_suffix: bool = field(False, "no random suffix on the W&B group and run name")

    def __post_init__(self) -> None:
        check_fields(self)
        if self.ckpt_step is not None and not self.load:
            raise ValueError(f"ckpt_step ({self.ckpt_step}) needs load and must be >= 0")
        if self.ref_ckpt_step is not None and not self.ref_load:
            raise ValueError(f"ref_ckpt_step ({self.ref_ckpt_step}) needs ref_load")
        if self.opd_teacher_ckpt_step is not None and not self.opd_teacher_load:
            raise ValueError(f"opd_teacher_ckpt_step ({self.opd_teacher_ckpt_step}) needs opd_teacher_load")
        if self.save_interval is not None and not self.save:
            raise ValueError("save_interval is set but save (the checkpoint directory) is not")
        if self.debug_rollout_only and (self.debug_train_only or self.load_debug_rollout_data):
            raise ValueError("debug_rollout_only excludes debug_train_only and load_debug_rollout_data")
        if self.debug_train_only and not self.load_debug_rollout_data:
            raise ValueError("debug_train_only needs load_debug_rollout_data (there are no engines to generate with)")
        for name in ("save_debug_rollout_data", "load_debug_rollout_data", "save_hf"):
            try:
                getattr(self, name).format(rollout_id=0)
            except (KeyError, IndexError, ValueError) as err:
                raise ValueError(f"{name}: bad pattern {getattr(self, name)!r} (only {{rollout_id}} is filled in: "
                                 f"{err})") from None
        if self.streams and self.update_weights_interval - 1 > self.max_weight_staleness:
            raise ValueError(f"mode fully_async: update_weights_interval {self.update_weights_interval} leaves the "
                             f"engines more than max_weight_staleness ({self.max_weight_staleness}) versions behind")
        if self.mode != "sync" and (self.debug_rollout_only or self.train_only):
            raise ValueError(f"mode {self.mode} needs engines and a trainer: not with debug_rollout_only, "
                             "debug_train_only or load_debug_rollout_data")

    @property
    def streams(self) -> bool:
        """fully_async: the manager streams groups across rollouts (no batch boundaries)."""
        return self.mode == "fully_async"

    @property
    def train_only(self) -> bool:
        """No engines, manager or buffer: rollouts come from load_debug_rollout_data."""
        return self.debug_train_only or bool(self.load_debug_rollout_data)

    @property
    def engines(self) -> bool:
        """Whether the job generates with engines (not when it trains on dumps)."""
        return not self.train_only
