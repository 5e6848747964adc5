"""megatron-core's load-balancing losses over a training step (aux_loss, seq_aux_loss, global_aux_loss): its routers
add them to the gradient and record each MoE layer's value in its tracker; here the tracker and the routers' running
global counts start afresh each step, and the step's value is read back as the fsdp backend reports its own (summed
over the MoE layers, the mean over the step's micro-batches, averaged over the data-parallel ranks; global_aux_loss's
per-rank shares summed, each rank weighing its own tokens by the counts of all)."""

from __future__ import annotations

import torch

TRACKER_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
                 "global_aux_loss": "global_load_balancing_loss"}


def start_step(gpt: torch.nn.Module) -> None:
    """Zero megatron-core's loss tracker and every router's token counts of global_aux_loss (its running average
    spans one step's micro-batches, as Megatron-LM resets it each iteration)."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker
    from megatron.core.transformer.moe.router import Router

    clear_aux_losses_tracker()
    for module in gpt.modules():
        if isinstance(module, Router):
            module.reset_global_aux_loss_tracker()


def step_value(kind: str, *, num_layers: int, num_micro_batches: int, device: torch.device) -> float:
    """Collective over every rank: the step's load-balancing loss of type `kind`, the same on every rank (a pipeline
    stage without MoE layers contributes zeros)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    tracker = get_moe_layer_wise_logging_tracker().get(TRACKER_NAMES[kind])
    values = tracker["values"].detach().clone().float() if tracker else torch.zeros(num_layers, device=device)
    values /= num_micro_batches
    dist.all_reduce(values, group=ps.get_pipeline_model_parallel_group())
    if kind == "global_aux_loss":
        dist.all_reduce(values, group=ps.get_tensor_and_data_parallel_group(with_context_parallel=True))
    else:
        dist.all_reduce(values, group=ps.get_tensor_and_context_parallel_group())
        dist.all_reduce(values, group=ps.get_data_parallel_group())
        values /= ps.get_data_parallel_world_size()
    return float(values.sum())
