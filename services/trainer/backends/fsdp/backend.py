"""The torch backend: an HF causal LM with AdamW and gradient accumulation on the rank's device, in one process or
data-parallel over the trainer's ranks with FSDP2 (each rank trains its share of every step, `parallel.py`). Master
weights are float32; under bf16 the forward runs in bfloat16 (autocast on one rank, FSDP2's mixed-precision policy
over several), log-probs and losses in float32. Each micro-batch is one packed row (`packing.py`), as in slime; under
context parallelism each rank of a group holds a slice of it (`context_parallel.py`).

It owns the models (policy, reference, PPO critic), the optimizers and the step loop; every formula from the forward
outputs to the loss is in `rl_step` (shared with the Megatron backend). Sharding and the ranks are
`parallel.py`'s; checkpoint files `checkpoint/iterations.py`'s; the weight broadcast to engines `weight_sync.py`'s.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import math
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from services.common.errors import InvalidArgument
from services.common.samples import Sample
from services.common.shares import Share
from services.trainer.backends import capabilities, compiled_layers, last_layer_rows
from services.trainer.backends.base import load_custom_loss
from services.trainer.backends.fsdp import context_parallel, cp_attention, fused_head
from services.trainer.backends.fsdp.critic import Critic
from services.trainer.backends.fsdp.idle_vision import IdleVision
from services.trainer.batching import packing, varlen, vision
from services.trainer.batching.batch import RolloutBatch, build_rollout_batch
from services.trainer.batching.schedule import MicroBatch, Step, split_to, step_schedule
from services.trainer.checkpoint.hf_files import INPUT_FILES, copy_side_files
from services.trainer.checkpoint.torch_state import TorchStateDicts, load_causal_lm
from services.trainer.distributed import devices, parallel
from services.trainer.lora import export as lora_export
from services.trainer.lora import layers as lora_layers
from services.trainer.moe import hf_aux_loss
from services.trainer.moe.hf_routing_replay import RoutingReplay
from services.trainer.settings.train import TrainConfig
from services.trainer.step import hooks, rl_step
from services.trainer.step.optim import lr_schedule, make_adamw, scheduled_step

log = logging.getLogger(__name__)



class TorchBackend(TorchStateDicts):
    """One process, one model: `train_rollout` runs slime's per-rollout schedule (recompute old / reference
    log-probs and critic values, advantages, then global_batch_size steps of micro-batches)."""

    def __init__(self, model_path: str | Path, config: TrainConfig, num_threads: int | None = None,
                 world: parallel.World | None = None, job_global_batch_size: int | None = None,
                 pack_sequences: bool = True, min_padding_to_pack: float = packing.MIN_PADDING_TO_PACK,
                 context_parallel_size: int = 1, base_model: torch.nn.Module | None = None) -> None:
        self.model_path = Path(model_path)
        self.config = config
        # a micro-batch with enough padding runs as one packed row (`packing.worth_packing`); False: always a padded
        # rectangle (the reference the tests hold it to)
        self.pack_sequences = pack_sequences
        self.min_padding_to_pack = min_padding_to_pack
        # the job's step size: `config` holds this rank's share of it when the world has more than one rank
        self.job_global_batch_size = job_global_batch_size or config.global_batch_size
        self.world = world or parallel.World()
        # context parallelism (`context_parallel`): each sequence split over the ranks of a CP group
        self.cp = context_parallel.make_groups(self.world.rank, self.world.world_size, context_parallel_size)
        if num_threads:
            torch.set_num_threads(num_threads)
        torch.manual_seed(config.seed)
        self.device = self.world.device
        self.dtype = devices.train_dtype(config.bf16, self.device)
        devices.configure_matmul(self.device, allow_tf32=config.allow_tf32)
        # a job whose prompts have images runs the image processor (batching/vision.py); the model is the whole
        # vision-language model whenever the checkpoint is one (`load_causal_lm`)
        self.image_processor = vision.load_image_processor(self.model_path) if config.multimodal_keys else None
        self._images: vision.RolloutImages | None = None  # the rollout being trained's, when it has images
        # a LoRA job beside others on one base (`lora/shared_base.py`): their loaded model, its adapter its own
        model = base_model if base_model is not None else \
            load_causal_lm(self.model_path, images=bool(config.multimodal_keys)).to(self.device)
        if config.freeze_vision:
            log.info("freeze_vision: %d vision tower parameters frozen", _freeze_vision_tower(model))
        if config.lora:  # the base frozen; its KL reference is itself with the adapters off, not a copy
            self.lora_modules = lora_layers.add_adapters(model, rank=config.lora_rank, alpha=config.lora_alpha,
                                                         dropout=config.lora_dropout,
                                                         target_modules=config.target_modules)
            log.info("LoRA: rank %d adapters on %d Linear layers", config.lora_rank, len(self.lora_modules))
        if self.pack_sequences and not varlen.packable(model):
            log.warning("%s cannot keep packed sequences apart (an attention that is not transformers' "
                        "AttentionInterface, or layers that mix tokens outside attention): micro-batches stay padded",
                        type(model).__name__)
            self.pack_sequences = False
        if self.cp.size > 1:
            context_parallel.check(model, self.pack_sequences, config)
            cp_attention.use_in(model)  # the reference model is its copy
        self._tied_names = parallel.tied_names(model)
        # response log-probs from the final hidden states and the head, chunked (`fused_head`)
        self.fuse_head = config.log_probs_chunk_size > 0 and fused_head.fusable(model)
        # frozen copies: the reference model (KL) and the distillation teacher, each loaded over later when asked
        ref_model, teacher = (copy.deepcopy(model).requires_grad_(False) if needed else None
                              for needed in (config.needs_ref_model and not config.lora, config.needs_teacher_model))
        # the routing hooks go on the policy alone, after the frozen copies: those route as they are (slime's
        # "fallthrough")
        self.routing = RoutingReplay(model, model.config.get_text_config().num_hidden_layers) \
            if config.replays_routing else None
        if config.moe_aux_loss and (problem := capabilities.load_balancing_problem(
                "fsdp", config.moe_router_load_balancing_type)):
            raise InvalidArgument(problem)
        # over several ranks, a rank whose micro-batch has no images still runs the trained vision tower
        self._idle_vision = IdleVision(model) if self.image_processor is not None and self.world.distributed \
            and not config.freeze_vision else None
        self._router = hf_aux_loss.router_kind(model) if config.moe_aux_loss else None
        if config.compile_layers:
            for compiled in (model, ref_model, teacher):
                compiled_layers.compile_layers(parallel.decoder_layers(compiled) if compiled is not None else [])
        self.model = parallel.shard_model(model, self.world, param_dtype=self.dtype)
        self.ref_model, self.teacher_model = (None if frozen is None else parallel.shard_model(
            frozen, self.world, param_dtype=self.dtype) for frozen in (ref_model, teacher))
        # only the prompts' image tokens take image features (a policy may sample the image token as text)
        self._placeholders = vision.PromptPlaceholders()
        if self.image_processor is not None:
            for vlm in (self.model, self.ref_model, self.teacher_model):
                if vlm is not None:
                    self._placeholders.install(vlm)
        self.critic = Critic(self.model_path, config, device=self.device) if config.use_critic else None
        if self.critic is not None and self.cp.size > 1:
            cp_attention.use_in(self.critic.model.backbone)
        if self.critic is not None and self.world.distributed:  # its optimizer must hold the sharded parameters
            parallel.shard_model(self.critic.model, self.world, param_dtype=self.dtype)
            self.critic.optimizer = make_adamw(self.critic.model.named_parameters(), lr=config.lr,
                                               weight_decay=config.weight_decay, adam_beta1=config.adam_beta1,
                                               adam_beta2=config.adam_beta2, adam_eps=config.adam_eps)
        self.custom_loss = load_custom_loss(config.custom_loss_function_path) if config.custom_loss_function_path \
            else None
        hooks.load_all(config)
        # data-parallel ranks: normalize_advantages all-reduces its statistics over it
        self.dp_group = self.cp.dp_group if self.cp.size > 1 else \
            torch.distributed.group.WORLD if self.world.distributed else None
        self.optimizer = self._make_optimizer()
        pad = self.model.config.get_text_config().pad_token_id  # a vision-language config keeps it in its text part
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

    def _packs(self, mb: RolloutBatch) -> bool:
        """Rows with images stay padded: their rotary positions are the model's rope index's, per row."""
        return self.pack_sequences and mb.sample_index is None and packing.worth_packing(mb, self.min_padding_to_pack)

    def _model_inputs(self, mb: RolloutBatch, packed: bool) -> dict[str, torch.Tensor | int]:
        """Packed: one row whose position ids restart at each sequence, no attention mask, and the cumulative
        lengths by which `varlen`'s attention keeps the sequences apart (its forward runs under `varlen.packed_row`:
        HF builds no [T, T] mask from the positions); padded: the rectangle and its mask."""
        if packed:
            row = packing.pack(mb)
            return {"input_ids": row.input_ids, "position_ids": row.position_ids, "cu_seq_lens_q": row.cu_seqlens,
                    "cu_seq_lens_k": row.cu_seqlens, "max_length_q": row.max_seqlen, "max_length_k": row.max_seqlen}
        inputs = {"input_ids": mb.tokens, "attention_mask": mb.attention_mask}
        if mb.sample_index is not None and self._images is not None:
            inputs.update(self._images.forward_inputs(self.model, mb.sample_index, mb.tokens, mb.attention_mask,
                                                      mb.prompt_lengths, mb.loss_masks, self._placeholders))
        return inputs

    def _forward(self, model: torch.nn.Module, mb: RolloutBatch, *, response_only: bool = True,
                 router_logits: bool = False, fuse: bool = True) -> tuple[object, fused_head.Head | None]:
        """The HF forward's outputs: the response tokens' logits alone, [N, V] (`rl_step.response_row_log_probs`
        reads them): the model projects onto the vocabulary only the positions that predict a response token, no
        prompt's and no padding's (`packing.response_mask`); response_only=False (a custom loss, which takes them
        all): every position's, [b, L, V] padded or [1, T, V] packed. With each MoE layer's router logits when asked
        for; the policy replays the micro-batch's routed experts when it has them. Under the fused head
        (response_only, `fuse_head`) the rows are the final hidden states [N, H] instead, and the Head comes along."""
        packed = self._packs(mb)
        keep = {"logits_to_keep": packing.response_mask(mb, packed=packed)} if response_only else {}
        replay = contextlib.nullcontext()
        if self.routing is not None and model is self.model:
            replay = self.routing.replaying(mb.flat_routed_experts(packed=packed))
        inputs = self._model_inputs(mb, packed)
        idle = self._idle_vision is not None and model is self.model and torch.is_grad_enabled() \
            and "pixel_values" not in inputs
        fused = fuse and response_only and self.fuse_head
        last_mlp = self._last_mlp(model) if fused else None  # run on the positions the fused head reads alone
        with self._autocast(), replay, fused_head.hidden_states_out(model, fused) as head, \
                last_layer_rows.mlp_on_rows(last_mlp, keep["logits_to_keep"] if last_mlp else None,
                                            sequence_first=False), \
                self._idle_vision.running(idle) if idle else contextlib.nullcontext(), \
                varlen.packed_row(packed):
            out = model(**inputs, **keep, use_cache=False,
                        **({"output_router_logits": True} if router_logits else {}))
        return out, head

    def _last_mlp(self, model: torch.nn.Module) -> torch.nn.Module | None:
        """The model's last decoder layer's MLP when it is a dense one (`last_layer_rows`); none under compiled
        layers (a compiled layer's graph holds the MLP as it was)."""
        if self.config.compile_layers or not (layers := parallel.decoder_layers(model)):
            return None
        mlp = getattr(layers[-1], "mlp", None)
        return mlp if last_layer_rows.is_dense_mlp(mlp) else None

    def _logits(self, model: torch.nn.Module, mb: RolloutBatch, *, response_only: bool = True) -> torch.Tensor:
        """The projected logits, unfused: the response rows [N, V] or every position's."""
        return self._forward(model, mb, response_only=response_only, fuse=False)[0].logits

    def _values(self, mb: RolloutBatch) -> torch.Tensor:
        with self._autocast():
            if self.cp.size > 1:
                return context_parallel.response_values(self.critic.model, mb, self._cp_slice(mb))
            packed = self._packs(mb)
            with varlen.packed_row(packed):
                return self.critic.values(mb, self._model_inputs(mb, packed))

    def _cp_slice(self, mb: RolloutBatch) -> context_parallel.CPSlice:
        return context_parallel.split(mb, self.cp, self.pad_token_id)

    def _token_stats(self, logits: torch.Tensor, mb: RolloutBatch, *, with_entropy: bool = True,
                     head: fused_head.Head | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Response-aligned (log_probs, entropy) [b, R] from `_forward`'s rows: logits, or with the head the
        hidden states it projects."""
        if head is None:
            return rl_step.response_row_log_probs(logits, mb, self.config, with_entropy=with_entropy)
        cfg = self.config
        return fused_head.response_row_stats(logits, head, mb, temperature=cfg.rollout_temperature,
                                             chunk_size=cfg.log_probs_chunk_size, with_entropy=with_entropy,
                                             entropy_grad=cfg.entropy_coef != 0)

    def _model_stats(self, model: torch.nn.Module, mb: RolloutBatch, *,
                     with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Response-aligned (log_probs, entropy) [b, R] of `model` at the rollout temperature, on one rank or split
        over the context-parallel group."""
        if self.cp.size == 1:
            out, head = self._forward(model, mb)
            return self._token_stats(out.logits, mb, with_entropy=with_entropy, head=head)
        with self._autocast():
            return context_parallel.response_stats(model, mb, self._cp_slice(mb), self.config,
                                                   with_entropy=with_entropy)

    def _log_probs(self, model: torch.nn.Module, mb: RolloutBatch) -> torch.Tensor:
        """Response-aligned log-probs [b, R] at the rollout temperature."""
        return self._model_stats(model, mb, with_entropy=False)[0]

    def _schedule(self, batch: RolloutBatch, global_batch_size: int | None) -> list[Step]:
        """Each step's micro-batches. Over several ranks each step has as many on every rank (FSDP gathers and
        reduces at every forward and backward): the most any rank has, by halving this rank's heaviest (or, with
        no sample left to split off, an empty micro-batch that runs a zero-weighted forward)."""
        cfg = self.config
        lengths = batch.total_lengths
        # under CP a micro-batch's tokens are spread over the group (slime: max_tokens_per_gpu × cp_size)
        budget = cfg.max_tokens_per_gpu * self.cp.size if cfg.use_dynamic_batch_size else None
        steps = step_schedule(lengths, global_batch_size=global_batch_size, micro_batch_size=cfg.micro_batch_size,
                              max_tokens_per_gpu=budget)
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
        """This rank's share of each step (`parallel.rollout_share`): each rank reads its own from the buffer, the
        ranks of a CP group the same one."""
        return parallel.rollout_share(rank=self.cp.dp_rank, world_size=self.cp.dp_size,
                                      global_batch_size=self.job_global_batch_size,
                                      n_samples_per_prompt=self.config.n_samples_per_prompt)

    def _see_images(self, samples: Sequence[Sample]) -> None:
        """The rollout's images through the image processor, once per group, before its forwards."""
        has_images = any(s.images for s in samples)
        if has_images and self.image_processor is None:
            raise InvalidArgument("samples with images, but the job has no multimodal_keys: it trains the language "
                                  "model alone")
        self._images = vision.RolloutImages(self.image_processor, samples) if has_images else None

    def compute_log_probs(self, samples: Sequence[Sample]) -> list[list[float]]:
        self._see_images(samples)
        batch = build_rollout_batch(samples, pad_token_id=self.pad_token_id, device=self.device)
        (micro_batches,) = self._schedule(batch, None)
        log_probs = self._recompute(lambda mb: self._log_probs(self.model, mb), batch, micro_batches)
        return [log_probs[i, :n].tolist() for i, n in enumerate(batch.response_lengths.tolist())]

    def train_rollout(self, samples: Sequence[Sample]) -> list[dict[str, float]]:
        cfg = self.config
        self._see_images(samples)
        batch = build_rollout_batch(samples, pad_token_id=self.pad_token_id, reward_key=cfg.reward_key,
                                    device=self.device, routing_shape=self._routing_shape())
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

    def _routing_shape(self) -> tuple[int, int] | None:
        """(num_layers, top_k) of the engines' routed experts, when this job replays the rollout's routing."""
        if self.routing is None or not self.config.use_rollout_routing_replay:
            return None
        return self.routing.num_layers, self.routing.top_k

    def _prepare(self, batch: RolloutBatch, micro_batches: list[MicroBatch], num_steps: int,
                 train_actor: bool, samples: Sequence[Sample]) -> RolloutBatch:
        """Critic values, old and reference log-probs (each in the training micro-batches), then advantages."""
        if self.critic is not None:
            batch = batch.with_(values=self._recompute(self._values, batch, micro_batches))
        if not train_actor:
            return batch
        rollout, recorded = batch, []

        def log_probs_of(model: torch.nn.Module) -> torch.Tensor:
            if model is lora_layers.BASE_MODEL:
                with lora_layers.adapters_disabled(self.model):
                    return self._recompute(lambda mb: self._log_probs(self.model, mb), rollout, micro_batches)
            if model is self.model and self.routing is not None and rollout.routed_experts is None:
                # slime's "record" stage: the old policy's forward records the experts the training forwards replay
                log_probs, routed = self.routing.record_batch(lambda mb: self._log_probs(model, mb), rollout,
                                                              micro_batches, packs=self._packs)
                recorded.append(routed)
                return log_probs
            return self._recompute(lambda mb: self._log_probs(model, mb), rollout, micro_batches)

        batch = rl_step.with_advantages(batch, self.config, num_steps=num_steps, model=self.model,
                                        ref_model=self._reference(), teacher_model=self.teacher_model, samples=samples,
                                        group=self.dp_group, log_probs_of=log_probs_of)
        return batch.with_routed_experts(recorded[0].routed_experts) if recorded else batch

    def _reference(self) -> torch.nn.Module | None:
        """The KL reference model: its own copy, or under LoRA the policy with the adapters off."""
        if self.config.lora and self.config.needs_ref_model:
            return lora_layers.BASE_MODEL
        return self.ref_model

    def _actor_loss(self, mb: RolloutBatch, reduce, *,
                    num_micro_batches: int = 1) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The policy's loss on a micro-batch; the load-balancing loss is shared among the step's
        `num_micro_batches`."""
        cfg = self.config
        if self.cp.size > 1:  # routing replay and the MoE aux loss are refused at submit under CP
            log_probs, entropy = self._model_stats(self.model, mb, with_entropy=cfg.loss_type == "policy_loss")
            return rl_step.log_prob_loss(cfg, mb, log_probs=log_probs, entropy=entropy, reduce=reduce)
        out, head = self._forward(self.model, mb, response_only=cfg.loss_type != "custom_loss",
                                  router_logits=cfg.moe_aux_loss)
        loss, metrics = rl_step.micro_batch_loss(cfg, mb, logits=out.logits, reduce=reduce,
                                                 custom_loss_fn=self.custom_loss,
                                                 token_stats=functools.partial(self._token_stats, head=head))
        if not cfg.moe_aux_loss:
            return loss, metrics
        return hf_aux_loss.add_load_balancing_loss(
            loss, metrics, out.router_logits, mb, coeff=cfg.moe_aux_loss_coeff, router=self._router,
            packed=self._packs(mb), num_micro_batches=num_micro_batches, kind=cfg.moe_router_load_balancing_type)

    def _actor_step(self, batch: RolloutBatch, micro_batches: Step) -> dict[str, float]:
        metrics = self._train_step(self.model, self.optimizer, batch, micro_batches,
                                   functools.partial(self._actor_loss, num_micro_batches=len(micro_batches)))
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
        totals: dict[str, torch.Tensor] = {}  # summed where they are: one copy to the host after the loop
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
                value = torch.as_tensor(value, device=self.device).detach().double().reshape(())
                totals[key] = totals[key] + value if key in totals else value
        totals = dict(zip(totals, torch.stack(list(totals.values())).tolist(), strict=True)) if totals else {}
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

    def named_weights(self, *, adapters_merged: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """HF names and full tensors; a tied weight (lm_head.weight under tied embeddings) comes once, first name.
        Under FSDP every rank must call it: rank 0 gets the gathered weights, the others none. A LoRA policy's are
        its merged weights, or with adapters_merged=False its base model's."""
        weights = parallel.full_state_dict(self.model, self.world)
        if self.config.lora and adapters_merged:
            weights = lora_export.merged_state_dict(weights, scaling=self.config.lora_alpha / self.config.lora_rank)
        elif self.config.lora:
            weights = {name: t for name, t in weights.items() if not lora_export.is_adapter_key(name)}
        return iter([(name, t.detach()) for name, t in weights.items() if name not in self._tied_names])

    def adapter_weights(self) -> tuple[dict, list[tuple[str, torch.Tensor]]]:
        """PEFT's adapter config and the adapter's tensors under PEFT's names (rank 0; [] on the others)."""
        cfg = self.config
        weights = parallel.full_state_dict(self.model, self.world)
        config = lora_export.peft_config(rank=cfg.lora_rank, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout,
                                         target_modules=cfg.target_modules, base_model=str(self.model_path))
        return config, sorted(lora_export.peft_state_dict(weights).items())

    def save_hf(self, path: str | Path) -> None:
        """Write safetensors, config and tokenizer files transformers loads; under FSDP every rank calls it (the
        weights are gathered to rank 0, which writes)."""
        path = Path(path)
        weights = parallel.full_state_dict(self.model, self.world)
        if self.config.lora:
            self._save_lora(path, weights)
        elif self.world.rank == 0:
            path.mkdir(parents=True, exist_ok=True)
            # transformers 5 empties the state_dict it is given: pass a copy.
            self.model.save_pretrained(path, state_dict=dict(weights))
            copy_side_files(self.model_path, path, INPUT_FILES)  # save_pretrained wrote the configs
            log.info("saved HF checkpoint to %s", path)
        self.world.barrier()

    def _save_lora(self, path: Path, weights: dict[str, torch.Tensor]) -> None:
        """LoRA's HF export: PEFT's adapter directory at `path`, with lora_save_merged the merged model under
        path/merged."""
        cfg = self.config
        if self.world.rank == 0:
            lora_export.save_peft_adapter(path, weights, rank=cfg.lora_rank, alpha=cfg.lora_alpha,
                                          dropout=cfg.lora_dropout, target_modules=cfg.target_modules,
                                          base_model=str(self.model_path))
            copy_side_files(self.model_path, path, INPUT_FILES)
            if cfg.lora_save_merged:
                merged = lora_export.merged_state_dict(weights, scaling=cfg.lora_alpha / cfg.lora_rank)
                base = self._load_hf_model(self.model_path)  # the base architecture, without adapter layers
                base.load_state_dict(merged)
                base.save_pretrained(path / "merged", state_dict=dict(base.state_dict()))
                copy_side_files(self.model_path, path / "merged", INPUT_FILES)
            log.info("saved the LoRA adapter (PEFT format) to %s%s", path,
                     " and the merged model under merged/" if cfg.lora_save_merged else "")
        self.world.barrier()


def _freeze_vision_tower(model: torch.nn.Module) -> int:
    """freeze_vision: the vision tower (`model.visual` of a ...ForConditionalGeneration) keeps its loaded weights;
    returns how many parameters that freezes."""
    visual = getattr(getattr(model, "model", None), "visual", None)
    if visual is None:
        raise InvalidArgument(f"freeze_vision: {type(model).__name__} has no vision tower (model.visual)")
    visual.requires_grad_(False)
    return sum(p.numel() for p in visual.parameters())
