"""MegatronBackend: the TrainBackend of `backends/base.py` on megatron-core, with TP × PP × DP over torch.distributed.

Every rank of the job builds one and makes the same calls with the same samples (each method is collective). A
step's samples are cut into micro-batches, each one packed (THD) row, dealt to the data-parallel ranks by tokens
(`schedule.dp_schedule`) and run by Megatron's schedule (1F1B under PP). Every formula comes from
`step/rl_step.py`, on log-probs that `vocab_parallel` computes from the TP-sharded logits. Results (log-probs,
metrics) are the same on every rank; HF weights come out on rank 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from services.common.errors import InvalidArgument
from services.common.samples import Sample
from services.common.shares import Share
from services.trainer.algorithms.fused_log_probs import fused_log_probs_and_entropy
from services.trainer.algorithms.losses import Reducer
from services.trainer.backends import capabilities, compiled_layers, last_layer_rows
from services.trainer.backends.base import load_custom_loss
from services.trainer.backends.layout import CUSTOM_LOSS_REFUSAL
from services.trainer.backends.megatron import args as margs
from services.trainer.backends.megatron import context_parallel as megatron_cp
from services.trainer.backends.megatron import critic as value_model
from services.trainer.backends.megatron import fused_head
from services.trainer.backends.megatron import model as mcore
from services.trainer.backends.megatron import mtp as megatron_mtp
from services.trainer.backends.megatron.vocab_parallel import vocab_parallel_log_probs_and_entropy
from services.trainer.batching import packing
from services.trainer.batching import vision as batch_vision
from services.trainer.batching.batch import RolloutBatch, build_rollout_batch
from services.trainer.batching.schedule import MicroBatch, dp_schedule
from services.trainer.checkpoint import hf_io
from services.trainer.checkpoint.megatron_dist import MegatronCheckpointing
from services.trainer.checkpoint.megatron_hf import MegatronHFWeights
from services.trainer.distributed import devices, megatron_cpu
from services.trainer.models import families, mtp
from services.trainer.models.arch import ModelArch, uneven_stage_layers
from services.trainer.moe import megatron_aux_loss
from services.trainer.moe.megatron_routing_replay import MegatronRouting
from services.trainer.settings.train import TrainConfig
from services.trainer.step import hooks, optim, rl_step

log = logging.getLogger(__name__)

LossFn = Callable[[MicroBatch, RolloutBatch, torch.Tensor], torch.Tensor]  # (rows, micro-batch, logits) -> loss


class MegatronBackend(MegatronHFWeights, MegatronCheckpointing):
    """A policy as a Megatron GPTModel; `train_rollout` runs the same per-rollout schedule as TorchBackend.

    Joins the default process group that is already there (the trainer's `parallel.World`, passed as `world` and
    otherwise unused) or forms one from torchrun's env (a world of one without it); every rank gets the whole
    rollout. `megatron_args` is the job spec's `megatron:` section (Megatron's config fields, `args.split`)."""

    def __init__(self, model_path: str | Path, config: TrainConfig, *, tensor_model_parallel_size: int = 1,
                 pipeline_model_parallel_size: int = 1, use_distributed_optimizer: bool = True,
                 megatron_args: dict[str, Any] | None = None, num_threads: int | None = None, world=None,
                 expert_model_parallel_size: int = 1, expert_tensor_parallel_size: int = 1,
                 context_parallel_size: int = 1, pack_sequences: bool = True,
                 min_padding_to_pack: float = packing.MIN_PADDING_TO_PACK) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import finalize_model_grads

        if world is not None and world.device.type == "cpu" and torch.cuda.is_available():
            raise InvalidArgument("train_backend megatron on device cpu while CUDA is visible: Megatron takes every "
                                  "visible GPU; hide them (CUDA_VISIBLE_DEVICES=) to train on the CPU")
        self.model_path = Path(model_path)
        self.config = config
        # THD rows where they save tokens (`packing.worth_packing`); False: padded rectangles (the tests' reference)
        self.pack_sequences, self.min_padding_to_pack = pack_sequences, min_padding_to_pack
        self.megatron_args = margs.split(megatron_args)
        if num_threads:
            torch.set_num_threads(num_threads)
        hf_config = hf_io.read_config(self.model_path)
        tp, pp, ep = tensor_model_parallel_size, pipeline_model_parallel_size, expert_model_parallel_size
        self.arch = ModelArch.from_hf_config(hf_config)
        if config.multimodal_keys and not self.arch.vision_model_type and \
                families.is_vision_language(hf_config, images=True):  # Qwen3.5 with its vision tower
            self.arch = self.arch.with_vision(hf_config)
        stage_layers = uneven_stage_layers(self.arch.num_layers, pp, **self.megatron_args.pipeline_ends)
        self.arch = dataclasses.replace(self.arch, stage_layers=stage_layers, mtp_num_layers=config.mtp_num_layers or 0,
                                        vocab_size_divisible_by=self.megatron_args.vocab_size_divisible_by)
        if problem := _mtp_problem(config, hf_config):
            raise InvalidArgument(problem)
        self.trains_mtp = config.enable_mtp_training
        self._mtp_depths: list[torch.Tensor] = []  # the MTP layers' outputs for the loss computed next
        self.etp_size = expert_tensor_parallel_size
        self.arch.check_parallel(tp_size=tp, pp_size=pp, ep_size=ep, etp_size=self.etp_size,
                                 stage_layers=stage_layers)
        if config.replays_routing and not self.arch.num_experts:
            raise InvalidArgument("routing replay on train_backend megatron: the model has no MoE layers")
        layout = {"tp_size": tp, "sequence_parallel": bool(self.megatron_args.transformer.get("sequence_parallel"))}
        for setting, wanted in (("routing replay", config.replays_routing),
                                ("moe_aux_loss_coeff", config.moe_aux_loss)):
            if wanted and (problem := capabilities.router_problem(setting, "megatron", hf_config, **layout)):
                raise InvalidArgument(problem)
        if self.megatron_args.dropout and (problem := families.megatron_train_mode_problem(hf_config, **layout)):
            raise InvalidArgument(f"megatron dropout: train_backend megatron {problem.removeprefix('it ')}")
        if self.arch.dsa is not None:  # megatron-core's DSAttention takes padded rectangles alone, whole sequences
            self.pack_sequences = False
        if context_parallel_size > 1 and (problem := _context_parallel_problem(config, hf_config)):
            raise InvalidArgument(f"context_parallel_size {context_parallel_size}: {problem}")
        # a vision-language checkpoint: megatron's language model with transformers' vision tower (`vision.py`); a
        # job with multimodal_keys runs its images through the image processor (batching/vision.py)
        self.vision_config = None
        if self.arch.vision_model_type:
            from services.trainer.backends.megatron import vision

            self.vision_config = vision.load_vision_config(self.model_path)
        elif config.multimodal_keys:
            raise InvalidArgument(f"multimodal_keys: model_type {hf_config.get('model_type')!r} has no vision tower")
        self.image_processor = batch_vision.load_image_processor(self.model_path) if config.multimodal_keys else None
        self._images: batch_vision.RolloutImages | None = None  # the rollout being trained's, when it has images
        mcore.init_distributed(tp_size=tp, pp_size=pp, seed=config.seed, ep_size=ep, cp_size=context_parallel_size,
                               etp_size=self.etp_size)
        self.cp_size, self.cp_rank = context_parallel_size, ps.get_context_parallel_rank()
        self.cp_group = ps.get_context_parallel_group() if context_parallel_size > 1 else None
        self.dp_cp_rank = ps.get_data_parallel_rank(with_context_parallel=True)  # one rank of a CP group sends weights
        self._cp_row: megatron_cp.CPRow | None = None  # the micro-batch whose loss is computed next (CP > 1)
        self._head: fused_head.Head | None = None  # the output layer's weight for the loss computed next (fused)
        self.ep_size, self.ep_rank = ep, ps.get_expert_model_parallel_rank()
        self.etp_rank = ps.get_expert_tensor_parallel_rank()
        self.etp_group = ps.get_expert_tensor_parallel_group() if self.etp_size > 1 else None
        self.ep_group = ps.get_expert_model_parallel_group() if ep > 1 else None
        self.expert_dp_rank = ps.get_expert_data_parallel_rank() if ep > 1 else 0
        self.tp_size, self.tp_rank = tp, ps.get_tensor_model_parallel_rank()
        self.pp_size, self.pp_rank = pp, ps.get_pipeline_model_parallel_rank()
        self.tp_group, self.pp_group = ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group()
        self.dp_size, self.dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        self.is_first_stage, self.is_last_stage = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        self.device = (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                       else megatron_cpu.CPU)
        self.dtype = devices.train_dtype(config.bf16, self.device)
        if self.arch.dsa is not None and self.megatron_args.transformer.get("dsa_indexer_loss_coeff") and \
                self.device.type != "cuda":
            raise InvalidArgument("megatron.dsa_indexer_loss_coeff: megatron-core 0.16.1 logs the DSA indexer's KL "
                                  "loss on CUDA only; train GLM-5's indexer on GPUs, or keep it as loaded (0)")
        devices.configure_matmul(self.device, allow_tf32=config.allow_tf32)
        # the hybrid stacks (gated delta-nets) are built of local modules, Transformer Engine or not (`hybrid.py`)
        self.use_te = mcore.has_transformer_engine() and self.arch.linear_attention is None
        self.use_distributed_optimizer = use_distributed_optimizer
        self.custom_loss = load_custom_loss(config.custom_loss_function_path) if config.custom_loss_function_path \
            else None
        hooks.load_all(config)

        hf = hf_io.HFTensors(self.model_path)
        gpt = self._build_gpt()
        self._copy_hf_weights(gpt, hf)
        if config.freeze_vision:  # the vision tower keeps its loaded weights (the first stage holds it)
            if self.vision_config is None:
                raise InvalidArgument("freeze_vision: the model has no vision tower")
            if gpt.visual is not None:
                gpt.visual.requires_grad_(False)
        if hasattr(gpt, "mtp") and not self.trains_mtp:  # carried (saved, sent to the engines), not trained
            gpt.mtp.requires_grad_(False)
        model_config = gpt.config
        self.routing = MegatronRouting(gpt, self.arch.num_layers, self.arch.moe_router_topk,
                                       sequence_parallel_group=self.tp_group if model_config.sequence_parallel
                                       else None) if config.replays_routing else None
        self.model = mcore.wrap_ddp(gpt, model_config, use_distributed_optimizer=use_distributed_optimizer,
                                    overrides=self.megatron_args.ddp)
        model_config.no_sync_func = self.model.no_sync
        model_config.finalize_model_grads_func = finalize_model_grads
        if self.arch.mtp_num_layers and pp > 1 and not self.arch.tie_word_embeddings and \
                (self.is_first_stage or self.is_last_stage):
            # the last stage's copy of the embedding (its MTP layers') and the first stage's: one weight
            model_config.finalize_model_grads_func = megatron_mtp.finalize_with_embedding_copy(
                finalize_model_grads, ps.get_embedding_group())
        self.optimizer = self._build_optimizer()
        self._num_steps = 0  # optimizer steps taken: the lr schedule's clock
        # PPO's value model: the policy's backbone with a value head, its own DDP, optimizer and lr clock
        self.critic = self._build_critic(hf, hf_config.get("initializer_range", 0.02)) if config.use_critic else None
        # frozen models: the reference (KL) and the distillation teacher, each loaded over later when asked
        self.ref_model, self.teacher_model = (self._frozen_copy(hf) if needed else None
                                              for needed in (config.needs_ref_model, config.needs_teacher_model))
        if config.compile_layers:  # this stage's decoder layers, in the policy and the frozen copies alike
            for compiled in (gpt, self.ref_model, self.teacher_model):
                compiled_layers.compile_layers(list(compiled.decoder.layers) if compiled is not None else [])
        pad = hf_config.get("pad_token_id")
        self.pad_token_id = 0 if pad is None else int(pad)
        self._weight_version = 0
        log.info("loaded %s into megatron: tp %d, pp %d, ep %d, dp %d, %s spec, %.1fM parameters on this rank",
                 self.model_path, tp, pp, ep, self.dp_size, "TE" if self.use_te else "local",
                 sum(p.numel() for p in gpt.parameters()) / 1e6)

    @property
    def weight_version(self) -> int:
        return self._weight_version

    @property
    def gpt(self):
        """The GPTModel (this rank's stage and TP shard) inside the DDP wrapper."""
        return self.model.module

    def _build_gpt(self, arch: ModelArch | None = None):
        arch = arch or self.arch
        config = mcore.transformer_config(arch, tp_size=self.tp_size, pp_size=self.pp_size, dtype=self.dtype,
                                          overrides={**mcore.router_fields(arch, self.config),
                                                     "context_parallel_size": self.cp_size,
                                                     **self.megatron_args.transformer})
        # eval: no dropout in log-prob recomputes (training forwards switch to train mode only under dropout)
        return mcore.build_gpt(arch, config, use_te=self.use_te, vision_config=self.vision_config).eval()

    def _build_optimizer(self, model=None):
        return mcore.build_optimizer(self.config, model or self.model,
                                     use_distributed_optimizer=self.use_distributed_optimizer, dtype=self.dtype,
                                     overrides=self.megatron_args.optimizer)

    def _build_critic(self, hf: hf_io.HFTensors, init_std: float) -> MegatronCritic:
        """The value model: the policy's GPTModel from its checkpoint, untied, with a value head for its output."""
        from megatron.core.distributed import finalize_model_grads

        gpt = self._build_gpt(dataclasses.replace(self.arch, tie_word_embeddings=False, mtp_num_layers=0))
        value_model.attach_value_head(gpt, hidden_size=self.arch.hidden_size, init_std=init_std, seed=self.config.seed)
        self._copy_hf_weights(gpt, hf, output_layer=False)
        model = mcore.wrap_ddp(gpt, gpt.config, use_distributed_optimizer=self.use_distributed_optimizer,
                               overrides=self.megatron_args.ddp)
        gpt.config.no_sync_func = model.no_sync
        gpt.config.finalize_model_grads_func = finalize_model_grads
        return MegatronCritic(model=model, optimizer=self._build_optimizer(model))

    # -- which rows this rank runs

    def _micro_batches(self, batch: RolloutBatch, rows: list[int], *, training: bool = True) -> list[MicroBatch]:
        """This data-parallel rank's micro-batches of `rows` (one step, or the whole batch): the rows cut into
        micro_batch_size chunks or packed by tokens, then dealt to the ranks by tokens (`schedule.dp_schedule`). A
        training step needs rows on every rank (each takes part in the gradient reduction)."""
        cfg = self.config
        if training and len(rows) < self.dp_size:
            raise InvalidArgument(f"a step of {len(rows)} samples cannot be split over {self.dp_size} data-parallel "
                                  "ranks (global_batch_size must be >= the data-parallel size)")
        return dp_schedule(batch.total_lengths, rows, dp_size=self.dp_size, micro_batch_size=cfg.micro_batch_size,
                           max_tokens_per_gpu=cfg.max_tokens_per_gpu if cfg.use_dynamic_batch_size else None
                           )[self.dp_rank]

    def _steps(self, batch: RolloutBatch) -> list[list[int]]:
        """The rows of each optimizer step: global_batch_size consecutive samples (None: all); the rest dropped."""
        step_size = self.config.global_batch_size or batch.size
        steps = [list(range(s, s + step_size)) for s in range(0, batch.size - step_size + 1, step_size)]
        if not steps:
            raise InvalidArgument(f"rollout has {batch.size} samples, fewer than global_batch_size {step_size}")
        if steps[-1][-1] + 1 < batch.size:
            log.warning("dropping the last %d of %d samples: they do not fill a step of global_batch_size %d",
                        batch.size - steps[-1][-1] - 1, batch.size, step_size)
        return steps

    # -- forward and backward through Megatron's schedule

    def _run(self, model, batch: RolloutBatch, micro_batches: list[MicroBatch], loss_fn: LossFn, *,
             forward_only: bool, routing: Callable | None = None) -> None:
        """Run `micro_batches` of `batch` through `model` (1F1B under PP); on the last stage loss_fn(rows, mb,
        logits [1, T, V/tp] packed or [b, L, V/tp] padded) gives the scalar to backpropagate."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if not micro_batches:  # a data-parallel replica with no rows (all of its ranks skip together)
            return

        pad_to = self.tp_size if self.gpt.config.sequence_parallel else 1  # each TP rank an equal slice
        # the policy's and the frozen models' forwards stop at the hidden states for the fused log-probs (`_head`);
        # not the critic's (a value head) nor under CP
        fuse = self._fuses_head() and self.cp_size == 1 and (self.critic is None or model is not self.critic.model)
        self._head = None
        last_mlp = self._last_mlp(model) if fuse else None  # run on the positions the fused head reads alone
        # megatron-core's MoE layers name CUDA devices in their forward (`megatron_cpu`); a dense one does not, nor
        # its backward (but under CP, whose forward runs in the mode)
        host_forward = contextlib.nullcontext if self.arch.num_experts else megatron_cpu.outside_cuda_to_cpu
        host_backward = not self.arch.num_experts and self.cp_size == 1

        def forward_step(data_iterator, module):
            rows, mb = next(data_iterator)
            packed = self._packs(mb)
            if self.cp_size > 1:  # this rank's slice; the loss, computed right after, gathers its outputs
                self._cp_row = self._cp_slice(mb)
                with routing(rows, mb) if routing else contextlib.nullcontext():
                    output = module(**self._cp_row.inputs)
                if self.is_last_stage and megatron_mtp.runs(fused_head.gpt_of(module)):
                    output, *self._mtp_depths = megatron_mtp.split_depths(
                        output, self.arch.mtp_num_layers, sequence_parallel_size=pad_to)
                return output, functools.partial(_loss_output, loss_fn, rows, mb)
            with host_forward():  # a dense model's inputs and outputs, not only its forward
                inputs = mcore.gpt_inputs(mb, packed=packed, use_te=self.use_te, pad_to=pad_to,
                                          pad_token_id=self.pad_token_id, padding_mask=self.config.moe_aux_loss)
                if self.vision_config is not None:
                    inputs.update(self._vision_inputs(mb, packed, inputs["input_ids"].shape[1]))
                if "padding_mask" in inputs and pad_to > 1 and not self.is_first_stage:
                    # megatron-core cuts the mask into the TP ranks' slices on the first pipeline stage only
                    inputs["padding_mask"] = inputs["padding_mask"].chunk(self.tp_size, dim=1)[self.tp_rank]
                with (routing(rows, mb) if routing else contextlib.nullcontext(),  # the policy's routing replay
                      fused_head.hidden_states_out(module, fuse) as head,
                      last_layer_rows.mlp_on_rows(last_mlp, packing.response_mask(mb, packed=packed) if last_mlp
                                                  else None, sequence_first=True)):
                    output = module(**inputs)
                self._head = head  # the loss, computed right after on the last stage, reads it
                if self.is_last_stage:  # the logits [b, s, V/tp] of the micro-batch's own positions
                    length = mcore.sequence_length(mb, packed=packed)
                    depths = megatron_mtp.split_depths(output, self.arch.mtp_num_layers,
                                                       sequence_parallel_size=pad_to) \
                        if megatron_mtp.runs(fused_head.gpt_of(module)) else [output]
                    output, self._mtp_depths = depths[0][:, :length], [depth[:, :length] for depth in depths[1:]]
                return output, functools.partial(_loss_output, loss_fn, rows, mb)

        data = [(rows, batch.take(rows).to(self.device)) for rows in micro_batches]
        # the shapes of the activations pipeline stages pass on: [T, 1, hidden] packed, [L, b, hidden] padded
        shapes = [(self._cp_slice(mb).local_length, 1 if self._packs(mb) else mb.size) if self.cp_size > 1 else
                  (_round_up(mcore.sequence_length(mb, packed=self._packs(mb)), pad_to),
                   1 if self._packs(mb) else mb.size) for _, mb in data]
        with megatron_cpu.cuda_to_cpu(), megatron_cpu.host_backward(host_backward), \
                (torch.no_grad() if forward_only else torch.enable_grad()):
            get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(data), model=[model],
                num_microbatches=len(data), seq_length=max(seq for seq, _ in shapes),
                micro_batch_size=max(rows for _, rows in shapes), forward_only=forward_only)

    def _vision_inputs(self, mb: RolloutBatch, packed: bool, length: int) -> dict[str, torch.Tensor]:
        """A vision-language model's inputs for the micro-batch laid out as `gpt_inputs` lays it (`length`
        positions, padding for sequence parallelism included): the multimodal rotary positions [3, b, length] on
        every stage, and on the first the pixel values and patch grids of its rows' images, in row order."""
        rows = batch_vision.image_rows(self._images, mb.sample_index) if mb.sample_index is not None \
            else [None] * mb.size
        image_token_id = self.vision_config.image_token_id
        # only the image tokens no policy sampled take image features (a policy may sample the image token as text)
        image_mask = batch_vision.image_token_mask(mb.tokens, mb.prompt_lengths, mb.loss_masks, image_token_id)
        positions = batch_vision.multimodal_positions(
            mb.tokens, mb.total_lengths, rows, image_token_id=image_token_id,
            merge_size=self.vision_config.vision_config.spatial_merge_size, image_mask=image_mask)
        if packed:  # the real tokens' positions side by side, then the padding's count from 0 (`gpt_inputs`)
            real = positions[:, mb.attention_mask.bool()]
            extra = torch.arange(length - real.shape[1], device=real.device).repeat(3, 1)
            positions = torch.cat([real, extra], dim=1)[:, None]
            image_mask = image_mask[mb.attention_mask.bool()][None]
        else:
            positions = torch.cat([positions, positions[..., -1:] + torch.arange(
                1, length - positions.shape[2] + 1, device=positions.device)], dim=2)
        out = {"position_ids": positions}
        images = [row for row in rows if row is not None]
        if images and self.is_first_stage:
            out["pixel_values"] = torch.cat([row.pixel_values for row in images]).to(self.device)
            out["image_grid_thw"] = torch.cat([row.image_grid_thw for row in images]).to(self.device)
            out["image_mask"] = torch.nn.functional.pad(image_mask, (0, length - image_mask.shape[1])).to(self.device)
        return out

    def _see_images(self, samples: Sequence[Sample]) -> None:
        """The rollout's images through the image processor, once per group, before its forwards."""
        has_images = any(s.images for s in samples)
        if has_images and self.image_processor is None:
            raise InvalidArgument("samples with images, but the job has no multimodal_keys: it trains the language "
                                  "model alone")
        self._images = batch_vision.RolloutImages(self.image_processor, samples) if has_images else None

    def _replay(self, model, record: torch.Tensor | None = None) -> Callable | None:
        """The policy's routing replay around each micro-batch's forward; none for the reference model."""
        policy = self.routing is not None and model is self.model
        return self.routing.around(packs=self._packs, record=record) if policy else None

    def _packs(self, mb: RolloutBatch) -> bool:
        return self.pack_sequences and packing.worth_packing(mb, self.min_padding_to_pack)

    def _cp_slice(self, mb: RolloutBatch) -> megatron_cp.CPRow:
        return megatron_cp.cp_row(mb, packed=self._packs(mb), rank=self.cp_rank, size=self.cp_size, group=self.cp_group,
                                  pad_token_id=self.pad_token_id,
                                  pad_multiple=self.tp_size if self.gpt.config.sequence_parallel else 1)

    def _per_position(self, output: torch.Tensor, mb: RolloutBatch) -> torch.Tensor:
        """Per-position outputs of the model: as they are, or under CP this rank's [rows, T_local] gathered into
        the CP-1 layout."""
        return self._cp_row.gather(output) if self.cp_size > 1 else output

    def _last_mlp(self, model) -> torch.nn.Module | None:
        """This stage's last layer's MLP when the fused head alone reads its output (`last_layer_rows`): on the last
        stage, a dense MLP, each TP rank holding every position (no sequence parallelism), no MTP layers reading
        every position's hidden state and no compiled layers (a compiled layer's graph holds the MLP as it was)."""
        gpt = fused_head.gpt_of(model)
        if not self.is_last_stage or gpt.config.sequence_parallel or megatron_mtp.runs(gpt) or \
                self.config.compile_layers or not len(gpt.decoder.layers):
            return None
        mlp = getattr(gpt.decoder.layers[-1], "mlp", None)
        return mlp if last_layer_rows.is_dense_mlp(mlp) else None

    def _fuses_head(self) -> bool:
        """Whether log-probs come from the hidden states and the output layer's weight, chunked (not for a custom
        loss, which takes the logits)."""
        return self.config.log_probs_chunk_size > 0 and self.config.loss_type != "custom_loss"

    def _token_stats(self, logits: torch.Tensor, mb: RolloutBatch, *,
                     with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Response-aligned (log_probs [b, R], entropy [b, R]) at the rollout temperature, from vocab-parallel
        logits, padded [b, L, V/tp] or packed [1, T, V/tp]; under CP, of this rank's slice (each position's stats
        against the token it predicts, gathered over the group)."""
        if (head := self._head) is not None:  # `logits` are the hidden states [b, s, H]
            cfg, rows = self.config, head.weight.shape[0]
            # the response tokens' positions alone (not the [b, R] rectangle's padding columns: packed rows of
            # long-tailed responses pad most of it), zero on the padding columns as the fsdp backend's
            valid = packing.response_valid(mb).to(logits.device)
            index = packing.response_index(mb, packed=packing.is_packed(logits, mb)).to(logits.device)[valid]
            log_probs, entropy = fused_log_probs_and_entropy(
                logits.flatten(0, 1).index_select(0, index), head.weight,
                mb.response_tokens.to(logits.device)[valid], temperature=cfg.rollout_temperature,
                with_entropy=with_entropy, entropy_grad=cfg.entropy_coef != 0, chunk_size=cfg.log_probs_chunk_size,
                vocab_size=self.arch.vocab_size, vocab_start=self.tp_rank * rows,
                group=self.tp_group if self.tp_size > 1 else None)
            return (packing.scatter_response(log_probs, mb),
                    None if entropy is None else packing.scatter_response(entropy, mb))
        if self.cp_size > 1:
            log_probs, entropy = vocab_parallel_log_probs_and_entropy(
                logits, self._cp_row.targets, vocab_size=self.arch.vocab_size,
                temperature=self.config.rollout_temperature, tp_rank=self.tp_rank, tp_size=self.tp_size,
                group=self.tp_group, with_entropy=with_entropy, entropy_grad=self.config.entropy_coef != 0)
            gathered = [None if x is None else packing.gather_response(self._cp_row.gather(x), mb)
                        for x in (log_probs, entropy)]
            return gathered[0], gathered[1] if with_entropy else None
        log_probs, entropy = vocab_parallel_log_probs_and_entropy(
            packing.gather_response(logits, mb), mb.response_tokens, vocab_size=self.arch.vocab_size,
            temperature=self.config.rollout_temperature, tp_rank=self.tp_rank, tp_size=self.tp_size,
            group=self.tp_group, with_entropy=with_entropy, entropy_grad=self.config.entropy_coef != 0)
        return log_probs, entropy if with_entropy else None

    def _log_probs(self, model, batch: RolloutBatch, micro_batches: list[MicroBatch],
                   record: torch.Tensor | None = None) -> torch.Tensor:
        """[B, R] log-probs without grad of every row in the batch, on every rank (each DP replica computes
        its micro_batches' rows; their reporters' results are summed). `record` [B, L, layers, top_k]: filled
        with the experts the policy routes this rank's rows to."""
        out = torch.zeros_like(batch.loss_masks)

        def store(rows: MicroBatch, mb: RolloutBatch, logits: torch.Tensor) -> torch.Tensor:
            log_probs, _ = self._token_stats(logits, mb, with_entropy=False)
            out[rows, :log_probs.shape[1]] = log_probs.cpu()
            return log_probs.sum() * 0.0

        self._run(model, batch, micro_batches, store, forward_only=True, routing=self._replay(model, record))
        if not self._is_reporter():
            out.zero_()
        return self._all_reduce(out)

    def _values(self, batch: RolloutBatch, micro_batches: list[MicroBatch]) -> torch.Tensor:
        """[B, R] critic values without grad of every row in the batch, on every rank (as `_log_probs`)."""
        out = torch.zeros_like(batch.loss_masks)

        def store(rows: MicroBatch, mb: RolloutBatch, output: torch.Tensor) -> torch.Tensor:
            values = value_model.response_values(self._per_position(output[..., 0], mb)[..., None], mb)
            out[rows, :values.shape[1]] = values.cpu()
            return values.sum() * 0.0

        self._run(self.critic.model, batch, micro_batches, store, forward_only=True)
        if not self._is_reporter():
            out.zero_()
        return self._all_reduce(out)

    def _is_reporter(self) -> bool:
        """One rank per data-parallel replica holds each result: the last stage's TP and CP rank 0."""
        return self.is_last_stage and self.tp_rank == 0 and self.cp_rank == 0

    def _all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.to(self.device)
        dist.all_reduce(tensor)
        return tensor.cpu()

    def _tp_broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """TP rank 0's `tensor`, on every rank of its tensor-parallel group (on the host)."""
        tensor = tensor.to(self.device)
        dist.broadcast(tensor, src=dist.get_global_rank(self.tp_group, 0), group=self.tp_group)
        return tensor.cpu()

    def rollout_share(self) -> Share:
        """Every rank reads the whole rollout: the backend splits each step over its data-parallel ranks."""
        return Share()

    def compute_log_probs(self, samples: Sequence[Sample]) -> list[list[float]]:
        self._see_images(samples)
        batch = build_rollout_batch(samples, pad_token_id=self.pad_token_id)
        micro = self._micro_batches(batch, list(range(batch.size)), training=False)
        log_probs = self._log_probs(self.model, batch, micro)
        return [log_probs[i, :n].tolist() for i, n in enumerate(batch.response_lengths.tolist())]

    # -- training

    def train_rollout(self, samples: Sequence[Sample]) -> list[dict[str, float]]:
        cfg = self.config
        r3 = (self.arch.num_layers, self.arch.moe_router_topk) if cfg.use_rollout_routing_replay else None
        self._see_images(samples)
        batch = build_rollout_batch(samples, pad_token_id=self.pad_token_id, reward_key=cfg.reward_key,
                                    routing_shape=r3)
        steps = [(rows, self._micro_batches(batch, rows)) for rows in self._steps(batch)]
        # slime's --num-critic-only-steps: the first rollouts train the critic alone
        train_actor = self.critic is None or self._weight_version >= cfg.num_critic_only_steps
        micro = [mb for _, step in steps for mb in step]
        if self.critic is not None:
            batch = batch.with_(values=self._values(batch, micro))
        if cfg.loss_type != "sft_loss" and train_actor:
            rollout, recorded = batch, []

            def log_probs_of(model: torch.nn.Module) -> torch.Tensor:
                # slime's "record" stage: the old policy's forward records the experts the training forwards replay
                record = self.routing.empty(*rollout.tokens.shape) \
                    if model is self.model and self.routing and not r3 else None
                recorded.extend([] if record is None else [record])
                log_probs = self._log_probs(model, rollout, micro, record)
                if record is not None and self.tp_size > 1:  # every TP rank's routers replay TP rank 0's record
                    record.copy_(self._tp_broadcast(record))
                return log_probs

            # Every rank holds the whole rollout, so advantages need no data-parallel all-reduce (group None).
            batch = rl_step.with_advantages(batch, cfg, num_steps=len(steps), model=self.model,
                                            ref_model=self.ref_model, teacher_model=self.teacher_model,
                                            samples=samples, log_probs_of=log_probs_of)
            batch = batch.with_routed_experts(recorded[0]) if recorded else batch
        metrics: list[dict[str, float]] = [{} for _ in steps]
        if self.critic is not None:
            critic_batch = batch.with_(returns=rl_step.critic_returns(batch, cfg, samples))
            for step_metrics, (rows, micro_batches) in zip(metrics, steps, strict=True):
                step_metrics.update(self._critic_step(critic_batch, rows, micro_batches))
        if train_actor:
            for step_metrics, (rows, micro_batches) in zip(metrics, steps, strict=True):
                step_metrics.update(self._train_step(batch, rows, micro_batches))
        self._weight_version += 1
        return metrics

    def _critic_step(self, batch: RolloutBatch, rows: list[int], micro_batches: list[MicroBatch]) -> dict[str, float]:
        """One step of the value model on the clipped value loss (its own lr clock)."""
        def loss(mb: RolloutBatch, output: torch.Tensor, reduce: Reducer):
            values = value_model.response_values(self._per_position(output[..., 0], mb)[..., None], mb)
            return rl_step.value_loss(self.config, mb, values=values, reduce=reduce)

        critic = self.critic
        metrics, grad_norm, _ = self._step(critic.model, critic.optimizer, critic.num_steps, batch, rows,
                                           micro_batches, loss, routing=None)
        critic.num_steps += 1
        return {"train/value_loss": metrics["value_loss"], "train/value_clipfrac": metrics["value_clipfrac"],
                "train/critic_grad_norm": grad_norm}

    def _micro_batch_loss(self, mb: RolloutBatch, logits: torch.Tensor,
                          reduce: Reducer) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """rl_step's loss of a micro-batch from vocab-parallel logits (custom_loss gets them gathered over TP)."""
        return rl_step.micro_batch_loss(self.config, mb, logits=logits, reduce=reduce,
                                        custom_loss_fn=self.custom_loss, token_stats=self._token_stats,
                                        full_logits=self._full_logits)

    def _with_mtp_loss(self, mb: RolloutBatch, logits: torch.Tensor, reduce: Reducer, *,
                       counts: list[float]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The micro-batch's policy loss plus its share of the step's MTP loss (`mtp.py`): depth k's cross-entropy
        summed over its trained tokens over the step's count of them (`counts`), the depths' sum times
        mtp_loss_scaling_factor / mtp_num_layers; metrics mtp_loss (the depths' sum) and mtp_{k}_loss."""
        loss, metrics = self._micro_batch_loss(mb, logits, reduce)
        mtp_loss = logits.new_zeros(())
        targets = self._cp_row.targets if self.cp_size > 1 else None  # under CP: each local position's next token
        for depth, (output, count) in enumerate(zip(self._mtp_depths, counts, strict=True), start=1):
            weights = megatron_mtp.target_weights(mb, depth).to(output.device)
            if self.cp_size > 1:  # this rank's slice against the tokens `depth` further on, gathered into CP 1's layout
                targets = megatron_mtp.next_tokens(targets, self.cp_group, self._cp_row.inputs.get("packed_seq_params"))
                per_position = self._cp_row.gather(self._target_log_probs(output, targets))
                log_probs = megatron_mtp.gather_depth(per_position[..., None], mb, depth)[..., 0]
            else:
                log_probs = self._target_log_probs(megatron_mtp.gather_depth(output, mb, depth), mb.response_tokens)
            depth_loss = -(log_probs * weights).sum() / max(count, 1.0)
            metrics[f"mtp_{depth}_loss"] = depth_loss.detach()
            mtp_loss = mtp_loss + depth_loss
        metrics["mtp_loss"] = mtp_loss.detach()
        return loss + mtp_loss * (self.config.mtp_loss_scaling_factor / self.arch.mtp_num_layers), metrics

    def _target_log_probs(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """[b, R] log-probs at temperature 1 of `targets` from response-aligned vocab-parallel logits, or hidden
        states under the fused head."""
        targets = targets.to(x.device)
        if (head := self._head) is not None:
            return fused_log_probs_and_entropy(
                x, head.weight, targets, temperature=1.0, with_entropy=False, entropy_grad=False,
                chunk_size=self.config.log_probs_chunk_size, vocab_size=self.arch.vocab_size,
                vocab_start=self.tp_rank * head.weight.shape[0], group=self.tp_group if self.tp_size > 1 else None)[0]
        return vocab_parallel_log_probs_and_entropy(
            x, targets, vocab_size=self.arch.vocab_size, temperature=1.0, tp_rank=self.tp_rank, tp_size=self.tp_size,
            group=self.tp_group, with_entropy=False, entropy_grad=False)[0]

    def _full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel logits gathered over TP, without the vocabulary's padding."""
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        full = gather_from_tensor_model_parallel_region(logits) if self.tp_size > 1 else logits
        return full[..., :self.arch.vocab_size]

    def _train_step(self, batch: RolloutBatch, rows: list[int], micro_batches: list[MicroBatch]) -> dict[str, float]:
        """One policy step over `rows` (with the MTP layers' loss when they train)."""
        loss_of = self._micro_batch_loss
        if self.trains_mtp:
            step = batch.take(rows)
            counts = [float(megatron_mtp.target_weights(step, depth).sum()) for depth in
                      range(1, self.arch.mtp_num_layers + 1)]
            loss_of = functools.partial(self._with_mtp_loss, counts=counts)
        with megatron_mtp.running(self.gpt, self.trains_mtp):
            metrics, grad_norm, lr = self._step(self.model, self.optimizer, self._num_steps, batch, rows,
                                                micro_batches, loss_of, routing=self._replay(self.model))
        self._num_steps += 1
        return {**{f"train/{key}": value for key, value in metrics.items()}, "train/grad_norm": grad_norm,
                "train/lr": lr}

    def _step(self, model, optimizer, num_steps: int, batch: RolloutBatch, rows: list[int],
              micro_batches: list[MicroBatch], loss_of: Callable, *,
              routing: Callable | None) -> tuple[dict[str, float], float, float]:
        """One optimizer step of `model` over `rows`, its lr schedule at `num_steps`; loss_of(mb, output, reduce)
        -> (loss, metrics). Each micro-batch's loss is its share of the step's loss (normalized by the whole
        step's sample or token count, over all DP ranks), times num_microbatches × dp_size to undo the schedule's
        and DDP's averaging: the gradient is that of the step's loss, however it is split. Under CP every rank of
        the group computes the whole loss, and the gather's backward already sums the group's gradients (CP times
        each rank's part) where the schedule multiplies the loss by CP for losses of a rank's own tokens: ÷ CP.
        Returns (metrics summed over the step, grad_norm, lr)."""
        cfg = self.config
        mask_sums = batch.loss_masks.sum(dim=-1)
        normalizer = rl_step.step_normalizer(cfg, mask_sums[rows])
        scale = len(micro_batches) * self.dp_size / self.cp_size
        totals: dict[str, torch.Tensor] = {}  # summed where they are: one copy to the host after the step

        def step_loss(mb_rows: MicroBatch, mb: RolloutBatch, logits: torch.Tensor) -> torch.Tensor:
            reduce = rl_step.make_reducer(cfg, mb.loss_masks, mask_sums[mb_rows].to(self.device), normalizer)
            loss, metrics = loss_of(mb, logits, reduce)
            for key, value in metrics.items():
                value = torch.as_tensor(value, device=self.device).detach().double().reshape(())
                totals[key] = totals[key] + value if key in totals else value
            return loss * scale

        model.zero_grad_buffer()
        optimizer.zero_grad()
        load_balancing = cfg.moe_aux_loss and model is self.model
        if load_balancing:
            megatron_aux_loss.start_step(model.module)
        # train mode only for dropout or megatron-core's load-balancing loss (its routers add it only in training);
        # the models stay in eval mode otherwise, so a step without either walks no module tree
        training = bool(self.megatron_args.dropout or self.config.moe_aux_loss)
        if training:
            model.train()
        try:
            self._run(model, batch, micro_batches, step_loss, forward_only=False, routing=routing)
        finally:
            if training:
                model.eval()
        self._count_experts_tokens_once(model.module)
        grad_norm, lr = self._optimizer_step(model, optimizer, num_steps, rows)
        metrics = self._sum_metrics(totals)
        if load_balancing:  # megatron-core's routers added it: the step's value, as the fsdp backend reports its own
            metrics["moe_aux_loss"] = megatron_aux_loss.step_value(
                cfg.moe_router_load_balancing_type, num_layers=self.arch.num_layers,
                num_micro_batches=len(micro_batches), device=self.device)
        return metrics, grad_norm, lr

    def _count_experts_tokens_once(self, gpt) -> None:
        """Without sequence parallelism every TP rank holds all of its replica's tokens, and under expert parallelism
        (or expert tensor parallelism) each sends them all to the experts' ranks: an expert's gradient, reduced over
        those ranks, holds each token tp_size times. Divide it back (whole experts on every rank, EP 1 and expert TP
        1, see only their own rank's tokens)."""
        if self.tp_size == 1 or (self.ep_size == 1 and self.etp_size == 1) or self.gpt.config.sequence_parallel:
            return
        for name, param in gpt.named_parameters():
            if param.requires_grad and ".mlp.experts." in name:  # the routed experts (not the shared ones)
                param.main_grad.div_(self.tp_size)

    def _optimizer_step(self, model, optimizer, num_steps: int, rows: list[int]) -> tuple[float, float]:
        """Clip and step at the lr scheduled for step `num_steps` (Megatron's lr_mult / wd_mult per group: no decay
        on biases and norms); a non-finite gradient norm raises before any weight changes. Returns (grad_norm,
        lr)."""
        cfg = self.config
        lr = optim.lr_at(num_steps, **optim.lr_schedule(cfg))
        for group in optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
            group["weight_decay"] = cfg.weight_decay * group.get("wd_mult", 1.0)
        with megatron_cpu.cuda_to_cpu():
            found_inf = optimizer.prepare_grads()
            grad_norm = float(optimizer.get_grad_norm())
            if found_inf or not math.isfinite(grad_norm):
                optimizer.zero_grad()
                model.zero_grad_buffer()
                raise FloatingPointError(f"grad norm is {grad_norm} on samples [{rows[0]}, {rows[-1] + 1}); "
                                         "step not applied")
            mcore.step_prepared(optimizer, grad_norm)  # not prepared and measured again
        return grad_norm, lr

    def _sum_metrics(self, totals: dict[str, torch.Tensor]) -> dict[str, float]:
        """The step's metrics: each DP replica's sums (held by its reporter rank) added up, on every rank."""
        gathered: list[dict[str, float] | None] = [None] * dist.get_world_size()
        local = dict(zip(totals, torch.stack(list(totals.values())).tolist(), strict=True)) if totals else {}
        if len(gathered) == 1:  # a world of one: nothing to gather (all_gather_object pickles through gloo)
            gathered = [local]
        else:
            dist.all_gather_object(gathered, local if self._is_reporter() else {})
        summed: dict[str, float] = {}
        for part in gathered:
            for key, value in (part or {}).items():
                summed[key] = summed.get(key, 0.0) + float(value)
        return summed

    def close(self) -> None:
        """Drop Megatron's process groups (the default group stays for the next backend in this process)."""
        mcore.destroy_model_parallel()


@dataclasses.dataclass
class MegatronCritic:
    """PPO's value model on megatron-core (`critic.py`): its DDP-wrapped GPTModel, optimizer and lr clock."""

    model: Any
    optimizer: Any
    num_steps: int = 0

    @property
    def gpt(self):
        return self.model.module


def _context_parallel_problem(config: TrainConfig, hf_config: dict) -> str:
    """Why this job cannot split its sequences over CP ranks here ("" when it can): its model's reason, the one the
    submit check gives (families.megatron_context_parallel_problem), then its settings'."""
    if problem := families.megatron_context_parallel_problem(hf_config, images=bool(config.multimodal_keys)):
        return problem
    if config.loss_type == "custom_loss":
        return CUSTOM_LOSS_REFUSAL.removeprefix("context_parallel_size > 1 ")
    if config.replays_routing or config.moe_aux_loss:
        return "routing replay and moe_aux_loss_coeff need each token's router logits on one rank"
    return ""


def _mtp_problem(config: TrainConfig, hf_config: dict) -> str:
    """Why this job cannot build or train its MTP layers here ("" when it can, or it has none)."""
    return mtp.problem(hf_config, config.mtp_num_layers) if config.mtp_num_layers else ""


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _loss_output(loss_fn: LossFn, rows: MicroBatch, mb: RolloutBatch, logits: torch.Tensor):
    """Megatron's loss_func contract: (loss, reported); the schedule divides the loss by num_microbatches. The loss
    names no CUDA device: it runs outside `megatron_cpu.cuda_to_cpu`'s mode."""
    with megatron_cpu.outside_cuda_to_cpu():
        return loss_fn(rows, mb, logits), {}
