"""The torch backend: an HF causal LM with AdamW and gradient accumulation on the rank's device, in one process or
data-parallel over the trainer's ranks with FSDP2 (each rank trains its share of every step, `parallel.py`). Master
weights are float32; under bf16 the forward runs in bfloat16 (autocast on one rank, FSDP2's mixed-precision policy
over several), log-probs and losses in float32. Each micro-batch is one packed row (`packing.py`), as in slime.

It owns the models (policy, reference, PPO critic), the optimizers and the step loop; every formula from the forward
outputs to the loss is in `rl_step` (shared with the Megatron backend). Sharding and the ranks are
`parallel.py`'s; checkpoint files `checkpoint.py`'s; the weight broadcast to engines `weight_sync.py`'s.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from services.common.errors import InvalidArgument
from services.common.samples import Sample
from services.common.shares import Share
from services.trainer import devices, parallel
from services.trainer.backends import packing, rl_step, slime_hooks, varlen
from services.trainer.backends.base import TrainConfig, load_custom_loss
from services.trainer.backends.batch import RolloutBatch, build_rollout_batch
from services.trainer.backends.critic import Critic
from services.trainer.backends.dcp import DCPCheckpointing
from services.trainer.backends.layout import LayoutConfig
from services.trainer.backends.optim import lr_schedule, make_adamw, scheduled_step
from services.trainer.backends.registry import register
from services.trainer.backends.schedule import MicroBatch, Step, split_to, step_schedule
from services.trainer.hf_files import TOKENIZER_FILES, copy_side_files

log = logging.getLogger(__name__)
TO_HF = "python -m services.trainer.backends.megatron.to_hf --hf-checkpoint HF_DIR --load ROOT --out DIR"



def _load_causal_lm(path: Path):
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    except (OSError, ValueError) as err:
        raise InvalidArgument(f"model {path}: cannot load a causal LM ({err})") from err
    varlen.use_in(model)  # packed rows take varlen flash attention where it applies
    # No dropout: the training forward, the no-grad recompute and the engines see the same policy.
    return model.eval()


class TorchBackend(DCPCheckpointing):
    """One process, one model: `train_rollout` runs slime's per-rollout schedule (recompute old / reference
    log-probs and critic values, advantages, then global_batch_size steps of micro-batches)."""

    def __init__(self, model_path: str | Path, config: TrainConfig, num_threads: int | None = None,
                 world: parallel.World | None = None, job_global_batch_size: int | None = None,
                 pack_sequences: bool = True) -> None:
        self.model_path = Path(model_path)
        self.config = config
        # each micro-batch one packed row (`packing`); False: a padded rectangle (the reference the tests hold it to)
        self.pack_sequences = pack_sequences
        # the job's step size: `config` holds this rank's share of it when the world has more than one rank
        self.job_global_batch_size = job_global_batch_size or config.global_batch_size
        self.world = world or parallel.World()
        if num_threads:
            torch.set_num_threads(num_threads)
        torch.manual_seed(config.seed)
        self.device = self.world.device
        self.dtype = devices.train_dtype(config.bf16, self.device)
        devices.configure_matmul(self.device, allow_tf32=config.allow_tf32)
        model = _load_causal_lm(self.model_path).to(self.device)
        if self.pack_sequences and not varlen.packable(model):
            log.warning("%s cannot keep packed sequences apart (an attention that is not transformers' "
                        "AttentionInterface, or layers that mix tokens outside attention): micro-batches stay padded",
                        type(model).__name__)
            self.pack_sequences = False
        self._tied_names = parallel.tied_names(model)
        # frozen copies: the reference model (KL) and the distillation teacher, each loaded over later when asked
        ref_model, teacher = (copy.deepcopy(model).requires_grad_(False) if needed else None
                              for needed in (config.needs_ref_model, config.needs_teacher_model))
        self.model = parallel.shard_model(model, self.world, param_dtype=self.dtype)
        self.ref_model, self.teacher_model = (None if frozen is None else parallel.shard_model(
            frozen, self.world, param_dtype=self.dtype) for frozen in (ref_model, teacher))
        self.critic = Critic(self.model_path, config, device=self.device) if config.use_critic else None
        if self.critic is not None and self.world.distributed:  # its optimizer must hold the sharded parameters
            parallel.shard_model(self.critic.model, self.world, param_dtype=self.dtype)
            self.critic.optimizer = make_adamw(self.critic.model.named_parameters(), lr=config.lr,
                                               weight_decay=config.weight_decay, adam_beta1=config.adam_beta1,
                                               adam_beta2=config.adam_beta2, adam_eps=config.adam_eps)
        self.custom_loss = load_custom_loss(config.custom_loss_function_path) if config.custom_loss_function_path \
            else None
        slime_hooks.load_all(config)
        # data-parallel ranks: normalize_advantages all-reduces its statistics over it
        self.dp_group = torch.distributed.group.WORLD if self.world.distributed else None
        self.optimizer = self._make_optimizer()
        pad = self.model.config.pad_token_id
        self.pad_token_id = 0 if pad is None else int(pad)
        self._weight_version = 0
        log.info("loaded %s: %.1fM parameters on %s (%s compute), loss %s, reference model %s", self.model_path,
                 sum(p.numel() for p in self.model.parameters()) / 1e6, self.device, self.dtype, config.loss_type,
                 self.ref_model is not None)

    def _autocast(self):
        """bf16 compute for float32 parameters on one rank; FSDP2's policy casts them itself over several."""
        return devices.autocast(self.device, torch.float32 if self.world.distributed else self.dtype)

    @property
    def weight_version(self) -> int:
        return self._weight_version

    def _make_optimizer(self) -> torch.optim.Optimizer:
        cfg = self.config
        return make_adamw(self.model.named_parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                          adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps)

    def load(self, path: str | Path) -> None:
        """Replace the policy's weights with an HF checkpoint's, with fresh optimizer state (the reference stays).
        Every rank calls it (each reads the directory)."""
        parallel.load_full_state_dict(self.model, _load_causal_lm(Path(path)).state_dict(), self.world)
        self.optimizer = self._make_optimizer()

    def load_ref(self, path: str | Path) -> None:
        """Replace the reference model's weights with an HF checkpoint's (slime's --ref-load)."""
        if self.ref_model is None:
            raise InvalidArgument("ref_load: this job has no reference model (use_kl_loss or kl_coef)")
        parallel.load_full_state_dict(self.ref_model, _load_causal_lm(Path(path)).state_dict(), self.world)

    def load_teacher(self, path: str | Path) -> None:
        """Replace the distillation teacher's weights with an HF checkpoint's (the policy's architecture)."""
        if self.teacher_model is None:
            raise InvalidArgument("opd_teacher_load: this job has no teacher model (use_opd with opd_type megatron)")
        parallel.load_full_state_dict(self.teacher_model, _load_causal_lm(Path(path)).state_dict(), self.world)

    def load_megatron_checkpoint(self, path: str | Path, into: str) -> None:
        raise InvalidArgument(f"checkpoint {path}: a slime (Megatron) torch_dist checkpoint loads on train_backend "
                              f"megatron; for fsdp convert it to an HF directory ({TO_HF}) and name that")

    def load_teacher_sharded(self, path: str | Path) -> None:
        """The policy of a checkpoint's dcp/ directory as the teacher."""
        self._load_policy_into(self.teacher_model, path)

    def update_ref_model(self) -> None:
        """Copy the policy into the reference model (slime's --ref-update-interval); shard by shard under FSDP."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

        set_model_state_dict(self.ref_model, get_model_state_dict(self.model))

    def state_dict(self, parts: Iterable[str] | None = None) -> dict[str, Any]:
        """What a checkpoint holds, by part: model and optim (the policy and its optimizer), ref_model, critic and
        critic_optim, weight_version; each rank's own shards under FSDP. parts None: every part that exists (an
        optimizer only once it has stepped); otherwise exactly those parts, e.g. to load them."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        wanted = None if parts is None else set(parts)
        out: dict[str, Any] = {}
        for name, optim, model, optimizer in self._checkpoint_parts():
            if model is not None and (wanted is None or name in wanted):
                out[name] = get_model_state_dict(model)
            # get_optimizer_state_dict steps a fresh optimizer (lr 0) to create its state: only to load into it.
            if optimizer is not None and (optim in wanted if wanted is not None else bool(optimizer.state)):
                for group in optimizer.param_groups:  # a checkpoint loads only the keys its target has
                    group.setdefault("num_steps", 0)  # optim.scheduled_step's count of steps taken
                out[optim] = get_optimizer_state_dict(model, optimizer)
        if wanted is None or "weight_version" in wanted:
            out["weight_version"] = self._weight_version
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load the parts `state` holds (as `state_dict` gives them, filled in from a checkpoint)."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        for name, optim, model, optimizer in self._checkpoint_parts():
            if name in state:
                set_model_state_dict(model, state[name])
            if optim in state:
                set_optimizer_state_dict(model, optimizer, state[optim])
        if "weight_version" in state:
            self._weight_version = int(state["weight_version"])

    def _checkpoint_parts(self) -> list[tuple[str, str, torch.nn.Module | None, torch.optim.Optimizer | None]]:
        """(model part, optimizer part, model, optimizer) of every model a checkpoint holds."""
        parts = [("model", "optim", self.model, self.optimizer), ("ref_model", "", self.ref_model, None)]
        if self.critic is not None:
            parts.append(("critic", "critic_optim", self.critic.model, self.critic.optimizer))
        return parts

    def _model_inputs(self, mb: RolloutBatch) -> dict[str, torch.Tensor | int]:
        """Packed: one row whose position ids restart at each sequence and no attention mask, from which HF builds
        a block-diagonal causal mask, and the cumulative lengths for varlen flash attention (`varlen`); padded: the
        rectangle and its mask."""
        if self.pack_sequences:
            row = packing.pack(mb)
            return {"input_ids": row.input_ids, "position_ids": row.position_ids, "cu_seq_lens_q": row.cu_seqlens,
                    "cu_seq_lens_k": row.cu_seqlens, "max_length_q": row.max_seqlen, "max_length_k": row.max_seqlen}
        return {"input_ids": mb.tokens, "attention_mask": mb.attention_mask}

    def _logits(self, model: torch.nn.Module, mb: RolloutBatch) -> torch.Tensor:
        """[b, L, V] padded or [1, T, V] packed: `packing.gather_response` reads either."""
        with self._autocast():
            return model(**self._model_inputs(mb), use_cache=False).logits

    def _values(self, mb: RolloutBatch) -> torch.Tensor:
        with self._autocast():
            return self.critic.values(mb, self._model_inputs(mb))

    def _log_probs(self, model: torch.nn.Module, mb: RolloutBatch) -> torch.Tensor:
        """Response-aligned log-probs [b, R] at the rollout temperature."""
        return rl_step.response_log_probs(self._logits(model, mb), mb, self.config, with_entropy=False)[0]

    def _schedule(self, batch: RolloutBatch, global_batch_size: int | None) -> list[Step]:
        """Each step's micro-batches. Over several ranks each step has as many on every rank (FSDP gathers and
        reduces at every forward and backward): the most any rank has, by halving this rank's heaviest (or, with
        no sample left to split off, an empty micro-batch that runs a zero-weighted forward)."""
        cfg = self.config
        lengths = batch.total_lengths
        steps = step_schedule(lengths, global_batch_size=global_batch_size, micro_batch_size=cfg.micro_batch_size,
                              max_tokens_per_gpu=cfg.max_tokens_per_gpu if cfg.use_dynamic_batch_size else None)
        if not self.world.distributed or not steps:
            return steps
        counts = torch.tensor([len(step) for step in steps], dtype=torch.long, device=self.world.comm_device)
        torch.distributed.all_reduce(counts, op=torch.distributed.ReduceOp.MAX)
        return [split_to(lengths, step, count) for step, count in zip(steps, counts.tolist(), strict=True)]

    @torch.no_grad()
    def _recompute(self, forward, batch: RolloutBatch, micro_batches: list[MicroBatch]) -> torch.Tensor:
        """[B, R] of `forward(mb) -> [b, R]` without grad, in the micro-batches the training forward will use."""
        out = torch.zeros_like(batch.loss_masks)
        for rows in micro_batches:
            if not rows:  # an empty micro-batch: the forward only keeps the ranks' collectives in step
                forward(batch.take([0]))
                continue
            values = forward(batch.take(rows))
            out[rows, :values.shape[1]] = values
        return out

    def rollout_share(self) -> Share:
        """This rank's share of each step (`parallel.rollout_share`): each rank reads its own from the buffer."""
        return parallel.rollout_share(rank=self.world.rank, world_size=self.world.world_size,
                                      global_batch_size=self.job_global_batch_size,
                                      n_samples_per_prompt=self.config.n_samples_per_prompt)

    def compute_log_probs(self, samples: Sequence[Sample]) -> list[list[float]]:
        batch = build_rollout_batch(samples, pad_token_id=self.pad_token_id, device=self.device)
        (micro_batches,) = self._schedule(batch, None)
        log_probs = self._recompute(lambda mb: self._log_probs(self.model, mb), batch, micro_batches)
        return [log_probs[i, :n].tolist() for i, n in enumerate(batch.response_lengths.tolist())]

    def train_rollout(self, samples: Sequence[Sample]) -> list[dict[str, float]]:
        cfg = self.config
        batch = build_rollout_batch(samples, pad_token_id=self.pad_token_id, reward_key=cfg.reward_key,
                                    device=self.device)
        steps = self._schedule(batch, cfg.global_batch_size)
        if not steps:
            raise InvalidArgument(f"rollout has {batch.size} samples, fewer than global_batch_size "
                                  f"{cfg.global_batch_size}")
        if (used := sum(len(mb) for step in steps for mb in step)) < batch.size:
            log.warning("dropping the last %d of %d samples: they do not fill a step of global_batch_size %d",
                        batch.size - used, batch.size, cfg.global_batch_size)
        # slime's --num-critic-only-steps: the first rollouts train the critic alone.
        train_actor = self.critic is None or self._weight_version >= cfg.num_critic_only_steps
        start = time.perf_counter()
        if cfg.loss_type != "sft_loss":
            batch = self._prepare(batch, [mb for step in steps for mb in step], len(steps), train_actor, samples)
        metrics: list[dict[str, float]] = [{} for _ in steps]
        metrics[0]["perf/log_probs_seconds"] = time.perf_counter() - start  # the rollout's recompute, once
        if self.critic is not None:
            critic_batch = batch.with_(returns=rl_step.critic_returns(batch, cfg, samples))
            for step_metrics, step in zip(metrics, steps, strict=True):
                step_metrics.update(self._critic_step(critic_batch, step))
        if train_actor:
            for step_metrics, step in zip(metrics, steps, strict=True):
                step_metrics.update(self._actor_step(batch, step))
        self._weight_version += 1
        return metrics

    def _prepare(self, batch: RolloutBatch, micro_batches: list[MicroBatch], num_steps: int,
                 train_actor: bool, samples: Sequence[Sample]) -> RolloutBatch:
        """Critic values, old and reference log-probs (each in the training micro-batches), then advantages."""
        if self.critic is not None:
            batch = batch.with_(values=self._recompute(self._values, batch, micro_batches))
        if not train_actor:
            return batch
        if rl_step.needs_old_log_probs(self.config, num_steps):
            batch = batch.with_(log_probs=self._recompute(lambda mb: self._log_probs(self.model, mb), batch,
                                                          micro_batches))
        if self.ref_model is not None:
            batch = batch.with_(ref_log_probs=self._recompute(lambda mb: self._log_probs(self.ref_model, mb), batch,
                                                              micro_batches))
        if self.teacher_model is not None:
            batch = batch.with_(teacher_log_probs=self._recompute(lambda mb: self._log_probs(self.teacher_model, mb),
                                                                  batch, micro_batches))
        return rl_step.compute_advantages_and_returns(batch, self.config, group=self.dp_group, samples=samples)

    def _actor_step(self, batch: RolloutBatch, micro_batches: Step) -> dict[str, float]:
        def loss_fn(mb: RolloutBatch, reduce):
            return rl_step.micro_batch_loss(self.config, mb, logits=self._logits(self.model, mb), reduce=reduce,
                                            custom_loss_fn=self.custom_loss)

        metrics = self._train_step(self.model, self.optimizer, batch, micro_batches, loss_fn)
        return {key if key.startswith("perf/") else f"train/{key}": value for key, value in metrics.items()}

    def _critic_step(self, batch: RolloutBatch, micro_batches: Step) -> dict[str, float]:
        def loss_fn(mb: RolloutBatch, reduce):
            return rl_step.value_loss(self.config, mb, values=self._values(mb), reduce=reduce)

        metrics = self._train_step(self.critic.model, self.critic.optimizer, batch, micro_batches, loss_fn)
        return {"train/value_loss": metrics["value_loss"], "train/value_clipfrac": metrics["value_clipfrac"],
                "train/critic_grad_norm": metrics["grad_norm"]}

    def _train_step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: RolloutBatch,
                    micro_batches: Step, loss_fn: rl_step.LossFn) -> dict[str, float]:
        """One optimizer step over a step's micro-batches. Losses are normalized by the whole step's sample (or
        token) count, so the loss and its gradient do not depend on how the step is cut into micro-batches."""
        cfg = self.config
        # Each sample is its own rollout here, so its denominator is its own loss-mask total (slime's
        # rollout_mask_sums with no fan-out).
        mask_sums = batch.loss_masks.sum(dim=-1)
        rows = [i for mb in micro_batches for i in mb]
        # Over data-parallel ranks, their counts' mean: FSDP averages gradients, so the loss is the whole step's.
        normalizer = parallel.dp_mean(rl_step.step_normalizer(cfg, mask_sums[rows]), self.world)
        optimizer.zero_grad(set_to_none=True)
        totals: dict[str, float] = {}
        start = time.perf_counter()
        for mb_rows in micro_batches:
            if not mb_rows:  # an empty micro-batch: a zero-weighted pass keeps the ranks' collectives in step
                mb = batch.take(rows[:1])
                loss, _ = loss_fn(mb, rl_step.make_reducer(cfg, mb.loss_masks, mask_sums[rows[:1]], normalizer))
                (loss * 0.0).backward()
                continue
            mb = batch.take(mb_rows)
            loss, metrics = loss_fn(mb, rl_step.make_reducer(cfg, mb.loss_masks, mask_sums[mb_rows], normalizer))
            loss.backward()
            for key, value in metrics.items():
                totals[key] = totals.get(key, 0.0) + float(value)
        forward_backward_s, start = time.perf_counter() - start, time.perf_counter()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.clip_grad if cfg.clip_grad > 0 else math.inf))
        if not math.isfinite(grad_norm):
            optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"grad norm is {grad_norm} on samples [{min(rows)}, {max(rows) + 1}); "
                                     "step not applied")
        lr = scheduled_step(optimizer, **lr_schedule(cfg))
        return {**totals, "grad_norm": grad_norm, "lr": lr, "perf/forward_backward_seconds": forward_backward_s,
                "perf/optimizer_seconds": time.perf_counter() - start}

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF names and full tensors; a tied weight (lm_head.weight under tied embeddings) comes once, first name.
        Under FSDP every rank must call it: rank 0 gets the gathered weights, the others none."""
        weights = parallel.full_state_dict(self.model, self.world)
        return iter([(name, t.detach()) for name, t in weights.items() if name not in self._tied_names])

    def save_hf(self, path: str | Path) -> None:
        """Write safetensors, config and tokenizer files transformers loads; under FSDP every rank calls it (the
        weights are gathered to rank 0, which writes)."""
        path = Path(path)
        weights = parallel.full_state_dict(self.model, self.world)
        if self.world.rank == 0:
            path.mkdir(parents=True, exist_ok=True)
            # transformers 5 empties the state_dict it is given: pass a copy.
            self.model.save_pretrained(path, state_dict=dict(weights))
            copy_side_files(self.model_path, path, TOKENIZER_FILES)  # save_pretrained wrote the configs
            log.info("saved HF checkpoint to %s", path)
        self.world.barrier()


@register("fsdp")
def build(hf_checkpoint: str, config: TrainConfig, layout: LayoutConfig, world: parallel.World,
          num_threads: int) -> TorchBackend:
    """Each rank gets a TrainConfig cut to its share of each step."""
    job_global_batch_size = config.global_batch_size
    if world.distributed:
        local = config.global_batch_size and config.global_batch_size // world.world_size
        config = dataclasses.replace(config, global_batch_size=local)
    return TorchBackend(hf_checkpoint, config, num_threads=num_threads, world=world,
                        job_global_batch_size=job_global_batch_size)
