"""Megatron-core pieces of the backend: process groups (TP × PP × DP), GPTModel from an HF config, DDP, optimizer.

The local layer spec on CPU (torch attention and torch RMSNorms that take sequence parallelism), the Transformer
Engine spec when transformer_engine is installed. Parameters in the training dtype (bf16: float32 main parameters in
the optimizer, gradients reduced in float32); dropout off, so training forwards and no-grad recomputes see one
policy. Knows nothing of HF names (checkpoint/megatron_convert.py) or losses (backend.py).
"""

from __future__ import annotations

import datetime
import importlib.util
import logging
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from services.common.errors import InvalidArgument
from services.trainer.backends.megatron import (
    args,
    host_linear,
    lone_replica,
    lone_shard,
    mtp,
    offload,
    own_main_params,
    rotary,
)
from services.trainer.batching import packing
from services.trainer.batching.batch import RolloutBatch
from services.trainer.distributed import megatron_cpu
from services.trainer.models.arch import ModelArch
from services.trainer.settings.train import TrainConfig
from services.trainer.step.optim import FUSED_DEVICES

log = logging.getLogger(__name__)

DIST_TIMEOUT = datetime.timedelta(minutes=10)  # slime's --distributed-timeout-minutes


def has_transformer_engine() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def init_distributed(*, tp_size: int, pp_size: int, seed: int, ep_size: int = 1, cp_size: int = 1,
                     etp_size: int = 1) -> None:
    """Join the default process group (torchrun's env, or a world of one) and cut it into Megatron's TP, PP, EP and
    DP groups (order tp-cp-ep-dp-pp: global rank 0 is TP, PP and DP rank 0; expert-parallel ranks are carved out of
    the tensor- and data-parallel ones: experts are never split by tensor parallelism, expert TP 1). Seeds the
    model-parallel RNG."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    megatron_cpu.apply()
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, timeout=DIST_TIMEOUT)
        else:  # one process, no launcher: a world of one on an in-memory store
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=DIST_TIMEOUT)
    world = dist.get_world_size()
    if world % (tp_size * pp_size * cp_size):
        raise InvalidArgument(f"world size {world} is not a multiple of tensor_model_parallel_size {tp_size} × "
                              f"pipeline_model_parallel_size {pp_size} × context_parallel_size {cp_size}")
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp_size,
                                             pipeline_model_parallel_size=pp_size, context_parallel_size=cp_size,
                                             expert_model_parallel_size=ep_size, expert_tensor_parallel_size=etp_size,
                                             distributed_timeout_minutes=int(DIST_TIMEOUT.total_seconds() // 60))
    model_parallel_cuda_manual_seed(seed)


def destroy_model_parallel() -> None:
    """Drop Megatron's groups (the default process group stays, for the next backend in this process) and the
    routers megatron-core's RouterReplay keeps in a class-wide list."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.router_replay import RouterReplay

    parallel_state.destroy_model_parallel()
    RouterReplay.clear_global_router_replay_instances()


def transformer_config(arch: ModelArch, *, tp_size: int, pp_size: int, dtype: torch.dtype = torch.float32,
                       overrides: dict | None = None):
    """The TransformerConfig of `arch`: RMSNorm, SwiGLU, GQA, RoPE, optional QKV bias and q/k norms, no dropout,
    MoE layers when it has experts; then the `megatron:` section's TransformerConfig fields (`args.split`)."""
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    on_gpu = torch.cuda.is_available()
    mla = {}
    if arch.mla is not None:  # multi-latent attention: its own config class (deepseek_v3.py's fields)
        from services.trainer.models import deepseek_v3, glm_moe_dsa

        mla = {**deepseek_v3.config_fields(arch), **glm_moe_dsa.config_fields(arch)}
    return args.build(MLATransformerConfig if mla else TransformerConfig, "TransformerConfig", dict(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size, ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads, num_query_groups=arch.num_query_groups,
        kv_channels=arch.head_dim, normalization="RMSNorm", layernorm_epsilon=arch.norm_epsilon,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=arch.qkv_bias,
        hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp_size, pipeline_model_parallel_size=pp_size,
        pipeline_dtype=dtype, params_dtype=dtype, bf16=dtype == torch.bfloat16, variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",  # dense model; the default rejects variable_seq_lengths
        use_cpu_initialization=not on_gpu,
        gradient_accumulation_fusion=False, bias_activation_fusion=False, masked_softmax_fusion=on_gpu,
        persist_layer_norm=False, bias_dropout_fusion=False, apply_rope_fusion=False, **moe_fields(arch),
        rotary_interleaved=arch.rotary_interleaved, **{**mla, "qk_layernorm": arch.qk_layernorm or bool(mla)},
        **linear_attention_fields(arch),
        **({"mrope_section": list(arch.mrope_section)} if arch.mrope_section else {})), overrides or {})


def linear_attention_fields(arch: ModelArch) -> dict:
    """TransformerConfig's fields of a hybrid stack's gated delta-nets and gated attention (none for others).
    experimental_attention_variant stays unset: `hybrid.py` builds the layers, ModelArch checks their TP sizes, and
    the variant would only make megatron-core's config refuse context parallelism, which `gated_delta_net.py` runs
    (megatron-core's own layer lacks it)."""
    shape = arch.linear_attention
    if shape is None:
        return {}
    return dict(attention_output_gate=arch.attention_output_gate,
                linear_attention_freq=[int(linear) for linear in arch.linear_layers],
                linear_conv_kernel_dim=shape.conv_kernel_dim, linear_key_head_dim=shape.key_head_dim,
                linear_value_head_dim=shape.value_head_dim, linear_num_key_heads=shape.num_key_heads,
                linear_num_value_heads=shape.num_value_heads)


def moe_fields(arch: ModelArch) -> dict:
    """TransformerConfig's MoE fields for `arch` (none for a dense model): HF's routing (softmax top-k, each token
    to its experts with no capacity limit, float32 router logits) and no load-balancing loss unless the job weighs
    one (`router_fields`); the expert-parallel size is the process groups'."""
    if not arch.num_experts:
        return {}
    from megatron.core import parallel_state

    fields = dict(num_moe_experts=arch.num_experts, moe_router_topk=arch.moe_router_topk,
                  moe_ffn_hidden_size=arch.moe_ffn_hidden_size, moe_router_pre_softmax=arch.moe_router_pre_softmax,
                  moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_router_dtype="fp32",
                  moe_grouped_gemm=False, moe_permute_fusion=False,
                  moe_router_score_function=arch.moe_router_score_function,
                  expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
                  expert_tensor_parallel_size=parallel_state.get_expert_tensor_parallel_world_size())
    if arch.moe_router_expert_bias:  # the bias stays the checkpoint's (slime's --moe-router-bias-update-rate 0)
        fields.update(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.0)
    if arch.moe_router_num_groups:
        fields.update(moe_router_num_groups=arch.moe_router_num_groups,
                      moe_router_group_topk=arch.moe_router_group_topk)
    if arch.moe_router_topk_scaling_factor:
        fields.update(moe_router_topk_scaling_factor=arch.moe_router_topk_scaling_factor)
    if arch.moe_shared_expert_intermediate_size:
        fields.update(moe_shared_expert_intermediate_size=arch.moe_shared_expert_intermediate_size,
                      moe_shared_expert_gate=arch.moe_shared_expert_gate)
    if arch.moe_layers is not None:
        fields.update(moe_layer_freq=[int(moe) for moe in arch.moe_layers])
    return fields


def router_fields(arch: ModelArch, train: TrainConfig) -> dict:
    """megatron-core's own load-balancing loss when the job weighs one (moe_aux_loss_coeff: its routers add it to the
    gradient, scaled by the schedule as the loss is, a step's the mean of its micro-batches'), and its RouterReplay
    under routing replay."""
    if not arch.num_experts:
        return {}
    fields = {"moe_enable_routing_replay": True} if train.replays_routing else {}
    if train.moe_aux_loss:  # aux_loss, seq_aux_loss or global_aux_loss (moe/megatron_aux_loss.py logs it)
        fields.update(moe_router_load_balancing_type=train.moe_router_load_balancing_type,
                      moe_aux_loss_coeff=train.moe_aux_loss_coeff)
    return fields


def build_gpt(arch: ModelArch, config, *, use_te: bool, vision_config=None):
    """This pipeline stage's GPTModel (padded vocab, vocab-parallel output), on the GPU when there is one; for a
    vision-language checkpoint (`vision_config`, its transformers config) with the vision tower (`vision.py`)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    from services.trainer.backends.megatron.attention import SDPAttention
    from services.trainer.backends.megatron.context_parallel import CPAttention
    from services.trainer.backends.megatron.norm import SequenceParallelRMSNorm
    from services.trainer.backends.megatron.swiglu import FusedSwiGLUMLP

    experts = arch.num_experts or None
    if arch.post_norms:  # GLM-4: a norm after attention's and the MLP's output projections
        from services.trainer.backends.megatron.post_norm import PostNormRowParallelLinear

        if use_te:
            raise InvalidArgument("megatron backend: GLM-4's post-attention and post-MLP norms are built on the local "
                                  "spec only (Transformer Engine is installed)")
        spec = get_gpt_layer_local_spec(qk_layernorm=False, normalization="RMSNorm")
        spec.submodules.self_attention.submodules.core_attention = SDPAttention
        spec.submodules.self_attention.submodules.linear_proj = PostNormRowParallelLinear
        spec.submodules.mlp.submodules.linear_fc2 = PostNormRowParallelLinear
        spec.submodules.mlp.module = FusedSwiGLUMLP
        spec = _with_norm(spec, SequenceParallelRMSNorm, config, qk_layernorm=False)
    elif arch.linear_attention is not None:  # Qwen3-Next, Qwen3.5: gated delta-nets among gated attention layers
        from services.trainer.backends.megatron.hybrid import hybrid_block

        spec = hybrid_block(arch, config, core_attention=CPAttention if config.context_parallel_size > 1
                            else SDPAttention)
    elif arch.mla is not None or arch.moe_layers is not None:  # layers of two kinds, or multi-latent attention
        block = _decoder_block(config, use_te=use_te)
        spec = block if use_te else _with_local_modules(
            block, CPAttention if config.context_parallel_size > 1 else SDPAttention, SequenceParallelRMSNorm)
        if arch.mla is not None and not use_te:
            from services.trainer.backends.megatron.mla import LatentRMSNorm

            for layer_spec in spec.layer_specs:
                attn = layer_spec.submodules.self_attention.submodules
                attn.q_layernorm = attn.kv_layernorm = LatentRMSNorm
        if arch.dsa is not None:  # GLM-5: DeepSeek sparse attention over the MLA
            from services.trainer.backends.megatron import dsa

            if use_te:
                raise InvalidArgument("megatron backend: GLM-5's sparse attention is built on the local spec only "
                                      "(Transformer Engine is installed)")
            dsa.use_sparse_attention(spec)
    elif use_te:
        if arch.projection_qk_norm:
            raise InvalidArgument("megatron backend: MiniMax-M2's whole-projection q/k norms are built on the local "
                                  "spec only (Transformer Engine is installed)")
        spec = get_gpt_layer_with_transformer_engine_spec(num_experts=experts, qk_layernorm=arch.qk_layernorm)
    else:
        spec = get_gpt_layer_local_spec(num_experts=experts, qk_layernorm=arch.qk_layernorm, normalization="RMSNorm")
        # torch's fused kernels; under context parallelism, attention across the CP group's slices
        spec.submodules.self_attention.submodules.core_attention = CPAttention \
            if config.context_parallel_size > 1 else SDPAttention
        if experts is None:  # SwiGLU on fc1's fused output, with no copy in its backward
            spec.submodules.mlp.module = FusedSwiGLUMLP
        spec = _with_norm(spec, SequenceParallelRMSNorm, config, qk_layernorm=arch.qk_layernorm)
        if arch.projection_qk_norm:  # MiniMax-M2: one norm over every head of the q (k) projection
            from services.trainer.backends.megatron.projection_norm import KProjectionRMSNorm, QProjectionRMSNorm

            attn = spec.layer_specs[0].submodules.self_attention.submodules
            attn.q_layernorm, attn.k_layernorm = QProjectionRMSNorm, KProjectionRMSNorm
    mtp_spec = None
    if arch.mtp_num_layers and parallel_state.is_pipeline_last_stage():
        mtp_layer, mtp_norm = spec, SequenceParallelRMSNorm  # as the decoder's last layer
        if arch.linear_attention is not None:  # Qwen3-Next's and Qwen3.5's: gated attention, zero-centered norms
            from services.trainer.backends.megatron import hybrid
            from services.trainer.backends.megatron.norm import ZeroCenteredRMSNorm

            mtp_layer = hybrid.layer_spec(arch, linear=False, moe=arch.is_moe_layer(arch.num_layers - 1),
                                          core_attention=CPAttention if config.context_parallel_size > 1
                                          else SDPAttention)
            mtp_norm = ZeroCenteredRMSNorm
        mtp_spec = _mtp_block(mtp_layer, arch.mtp_num_layers, mtp_norm, use_te=use_te)
    model_class, extra = GPTModel, {}
    if arch.vision_model_type:
        from services.trainer.backends.megatron import vision

        model_class = vision.vision_gpt_class()
        extra = {"position_embedding_type": "mrope", "scatter_embedding_sequence_parallel": False}
    rotary.apply()
    lone_shard.apply()
    host_linear.apply()
    with megatron_cpu.cuda_to_cpu():  # tied embeddings under PP: the output layer's copy is made with .cuda()
        model = model_class(
            config=config, transformer_layer_spec=spec, mtp_block_spec=mtp_spec,
            vocab_size=arch.padded_vocab_size(config.tensor_model_parallel_size),
            max_sequence_length=arch.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage(),
            parallel_output=True, share_embeddings_and_output_weights=arch.tie_word_embeddings,
            rotary_base=arch.rope_theta, rotary_percent=arch.rotary_percent,
            rope_scaling=arch.rope_scaling_factor is not None, rope_scaling_factor=arch.rope_scaling_factor or 8.0,
            **{"position_embedding_type": "rope", **extra})
        if arch.vision_model_type:
            model.attach_vision(vision_config, arch, config.params_dtype, torch.device("cpu"))
    if mtp_spec is not None:  # its MTP layers run only in the forwards that train them (`mtp.running`)
        mtp.run_only_when_asked(model)
        if not model.pre_process:  # the last of several stages: its own copy of the embedding (`mtp.py`)
            mtp.share_embedding_copy(model)
    if arch.mla is not None and not use_te:
        from services.trainer.backends.megatron.mla import whole_kv_down_projections

        whole_kv_down_projections(model, config)
    if arch.dsa is not None and not config.dsa_indexer_loss_coeff:
        from services.trainer.backends.megatron import dsa

        dsa.freeze_indexers(model)
    if config.tensor_model_parallel_size > 1 and config.expert_model_parallel_size == 1 and \
            config.expert_tensor_parallel_size == 1:
        # every TP rank holds all experts whole (expert TP 1), which megatron-core still marks tensor-parallel;
        # without expert parallelism they are dense parameters, so the gradient norm would count each tp_size times.
        # Under sequence parallelism each TP rank's experts see its slice of the tokens: their gradients are summed
        # over the TP ranks as the norms' are
        for name, param in model.named_parameters():
            if ".mlp.experts." in name:
                param.tensor_model_parallel = False
                param.sequence_parallel = config.sequence_parallel
    return model.cuda() if torch.cuda.is_available() else model


def _mtp_block(spec, num_layers: int, norm: type, *, use_te: bool):
    """megatron-core's block of `num_layers` multi-token-prediction layers, each with a transformer layer of `spec` (a
    layer's, or the block's: its last layer's) and, on the local spec, `norm` for its three RMSNorms."""
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionBlockSubmodules,
        get_mtp_layer_spec,
    )
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    layer = spec.layer_specs[-1] if isinstance(spec, TransformerBlockSubmodules) else spec
    mtp_layer = get_mtp_layer_spec(layer, use_transformer_engine=use_te)
    if not use_te:
        mtp_layer.submodules.enorm = mtp_layer.submodules.hnorm = mtp_layer.submodules.layer_norm = norm
    return MultiTokenPredictionBlockSubmodules(layer_specs=[mtp_layer] * num_layers)


def _decoder_block(config, *, use_te: bool):
    """megatron-core's block of this stage's layers, each a dense or MoE layer as config.moe_layer_freq says, with
    multi-latent attention when config.multi_latent_attention."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer import multi_latent_attention

    if importlib.util.find_spec("transformer_engine") is None:
        # without TransformerEngine megatron-core's TE extension imports with a MagicMock in its place, which MLA
        # takes for TransformerEngine (and then fails an isinstance check on it)
        multi_latent_attention.HAVE_TE = False
    return get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization="RMSNorm")


def _with_local_modules(block, attention: type, norm: type):
    """The local spec's block with `attention` as every core attention and `norm` for every RMSNorm."""
    from megatron.core.transformer.identity_op import IdentityOp

    for layer_spec in {id(spec): spec for spec in block.layer_specs}.values():
        layer = layer_spec.submodules
        layer.input_layernorm = layer.pre_mlp_layernorm = norm
        attn = layer.self_attention.submodules
        attn.core_attention = attention
        for name in ("q_layernorm", "k_layernorm", "kv_layernorm"):
            if getattr(attn, name, IdentityOp) is not IdentityOp:
                setattr(attn, name, norm)
    block.layer_norm = norm
    return block


def _with_norm(layer_spec, norm: type, config, *, qk_layernorm: bool):
    """The block of this stage's layers, `layer_spec` each, with `norm` for every RMSNorm (the final one too)."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    layer = layer_spec.submodules
    layer.input_layernorm = layer.pre_mlp_layernorm = norm
    if qk_layernorm:
        layer.self_attention.submodules.q_layernorm = layer.self_attention.submodules.k_layernorm = norm
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * get_num_layers_to_build(config), layer_norm=norm)


def wrap_ddp(model, config, *, use_distributed_optimizer: bool, overrides: dict | None = None):
    """Megatron DDP: grads in contiguous fp32 buffers, averaged over DP once per step (the loss undoes the mean)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = args.build(DistributedDataParallelConfig, "DistributedDataParallelConfig", dict(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=use_distributed_optimizer),
        overrides or {})
    lone_replica.apply()
    with megatron_cpu.cuda_to_cpu():
        ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    host_linear.mark(model, overlap_grad_reduce=ddp_config.overlap_grad_reduce)  # weight gradients into main_grad
    return ddp


def build_optimizer(train_config: TrainConfig, ddp_model, *, use_distributed_optimizer: bool,
                    dtype: torch.dtype = torch.float32, overrides: dict | None = None):
    """Megatron's Adam (decoupled weight decay, no decay on biases and norms), a constant lr (the backend sets each
    step's), global-norm clip, float32 main parameters under bf16; then the `megatron:` section's OptimizerConfig
    fields. With optimizer_cpu_offload, megatron-core's hybrid optimizer keeps the state on the host (`offload`)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    cfg = train_config
    overrides = overrides or {}
    args.check_optimizer(overrides, use_distributed_optimizer=use_distributed_optimizer)
    with offload.config_without_te():
        opt_config = args.build(OptimizerConfig, "OptimizerConfig", dict(
            optimizer="adam", lr=cfg.lr, min_lr=cfg.lr, weight_decay=cfg.weight_decay, adam_beta1=cfg.adam_beta1,
            adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps, clip_grad=cfg.clip_grad, params_dtype=dtype,
            bf16=dtype == torch.bfloat16, use_distributed_optimizer=use_distributed_optimizer,
            **offload.optimizer_fields(overrides)), overrides)
    offload.apply()
    own_main_params.apply()  # float32 shards are the model's own: no copy onto themselves after each step
    with megatron_cpu.cuda_to_cpu(), offload.leaf_fp32_shards():
        optimizer = get_megatron_optimizer(opt_config, [ddp_model])
    if not opt_config.optimizer_cpu_offload:  # the hybrid optimizer picks its own kernels
        _fused_adamw(optimizer)
    return optimizer


def step_prepared(optimizer, grad_norm: float) -> None:
    """optimizer.step() after its prepare_grads() and get_grad_norm() (`grad_norm`): megatron-core's ChainedOptimizer
    would copy the gradients to the main ones and take their norm again. The same clip by that norm (`_clip`), then
    the update. Any other optimizer, or one that counts zeros in the gradients, steps as it does."""
    from megatron.core.optimizer import ChainedOptimizer

    if type(optimizer) is not ChainedOptimizer or optimizer.config.log_num_zeros_in_grad:
        optimizer.step()
        return
    for inner in optimizer.chained_optimizers:  # as ChainedOptimizer.step clips
        if getattr(inner, "is_stub_optimizer", False):
            continue
        parameters = inner.get_parameters()
        if parameters and inner.config.clip_grad > 0.0:
            _clip(parameters, inner.config.clip_grad, grad_norm,
                  decoupled=inner.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
    optimizer.step_with_ready_grads()


def _clip(parameters: list, max_norm: float, total_norm: float, *, decoupled: bool) -> None:
    """megatron-core's clip_grad_by_total_norm_fp32; off CUDA one foreach multiply of every gradient by the same
    coefficient, where its host fallback multiplied each gradient into a new tensor and copied it back."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
    from megatron.core.utils import to_local_if_dtensor

    grads = [to_local_if_dtensor(grad).detach() for grad in
             ((getattr(param, "decoupled_grad", None) if decoupled else param.grad) for param in parameters)
             if grad is not None]
    if any(grad.is_cuda for grad in grads):
        clip_grad_by_total_norm_fp32(parameters, max_norm=max_norm, total_norm=total_norm,
                                     use_decoupled_grad=decoupled)
        return
    clip_coeff = max_norm / (total_norm + 1.0e-6)  # megatron-core's
    if clip_coeff < 1.0:
        torch._foreach_mul_(grads, clip_coeff)


def _fused_adamw(optimizer) -> None:
    """torch's AdamW under megatron-core's optimizer (torch's without Transformer Engine or Apex) through its fused
    kernel where every parameter it steps is a floating-point one on a device the kernel runs on: the same update,
    one pass over each parameter (`step.optim.make_adamw`)."""
    for wrapper in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(wrapper, "optimizer", None)
        if type(inner) is not torch.optim.AdamW:
            continue
        params = [p for group in inner.param_groups for p in group["params"]]
        if inner.state or not all(p.device.type in FUSED_DEVICES and p.is_floating_point() for p in params):
            continue
        inner.defaults.update(fused=True, foreach=None)
        for group in inner.param_groups:
            group.update(fused=True, foreach=None)


def gpt_inputs(mb: RolloutBatch, *, packed: bool, use_te: bool, pad_to: int = 1, pad_token_id: int = 0,
               padding_mask: bool = False) -> dict:
    """GPTModel's inputs for a micro-batch, on its device. Packed: one THD row with its cumulative lengths (RoPE
    restarts at each sequence, attention stays within it); padded: the rectangle under the causal mask (right
    padding is never attended to by a real token). pad_to: the row lengthened to a multiple of it with pad tokens
    (sequence parallelism cuts it into tp_size equal slices), packed as one more sequence, which no real token
    attends to; the logits' first `sequence_length(mb, packed)` positions are the micro-batch's. padding_mask: mark
    every pad token for the MoE routers (a load-balancing loss over the real tokens only)."""
    length = sequence_length(mb, packed=packed)
    extra = -length % pad_to
    if packed:
        from megatron.core.packed_seq_params import PackedSeqParams

        row = packing.pack(mb)
        input_ids, positions, cu_seqlens = row.input_ids, row.position_ids, row.cu_seqlens
        if extra:
            input_ids = F.pad(input_ids, (0, extra), value=pad_token_id)
            positions = torch.cat([positions, torch.arange(extra, device=mb.device)[None]], dim=1)
            cu_seqlens = torch.cat([cu_seqlens, cu_seqlens[-1:] + extra])
        max_seqlen = max(row.max_seqlen, extra)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                                 max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)
        inputs = {"input_ids": input_ids, "position_ids": positions, "attention_mask": None,
                  "packed_seq_params": params}
        real = torch.ones_like(row.input_ids, dtype=torch.bool)
    else:
        input_ids = F.pad(mb.tokens, (0, extra), value=pad_token_id)
        seq_len = length + extra
        mask = None if use_te else torch.triu(
            torch.ones(seq_len, seq_len, dtype=torch.bool, device=mb.device), diagonal=1)[None, None]
        positions = torch.arange(seq_len, device=mb.device).expand_as(input_ids)
        inputs = {"input_ids": input_ids, "position_ids": positions, "attention_mask": mask}
        real = mb.attention_mask.bool()
    if padding_mask:  # megatron-core's padding_mask is True on the pad tokens
        inputs["padding_mask"] = ~F.pad(real, (0, extra), value=False)
    return inputs


def sequence_length(mb: RolloutBatch, *, packed: bool) -> int:
    """The micro-batch's row length before any padding for sequence parallelism: its tokens packed, or the
    rectangle's."""
    return sum(mb.total_lengths) if packed else mb.tokens.shape[1]
