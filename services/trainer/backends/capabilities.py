"""What each training backend can do, declared once per backend: everyone else (the job spec's checks, the layout,
the model families, the CLI) asks a backend's `Capabilities`, never its name.

Torch-free, so a job is checked against it at submit, before any model loads. `registry.py` builds a backend by
name; a backend registers only under a name declared here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from services.common.errors import InvalidArgument
from services.trainer.models import families

BackendName = Literal["fsdp", "megatron"]


@dataclass(frozen=True, kw_only=True)
class Capabilities:
    critic: bool  # trains PPO's value model beside the policy
    packing: bool  # runs a micro-batch as one packed row (varlen attention / THD) when that saves tokens
    tensor_parallel: bool  # tensor_model_parallel_size > 1
    pipeline_parallel: bool  # pipeline_model_parallel_size > 1
    expert_parallel: bool  # expert_model_parallel_size > 1: a MoE model's experts spread over ranks
    context_parallel: bool  # one long sequence split over ranks
    extra_flags: bool  # takes the job's `megatron:` section (Megatron's config fields by name)
    reads_shares: bool  # each data-parallel rank reads its own share of a rollout (whole groups), not all of it
    slime_checkpoints: bool  # loads slime's torch_dist checkpoints (megatron-core dist-checkpointing) as they are
    vision: bool = False  # prompts with images (multimodal_keys): the vision inputs in the policy's forward
    lora: bool = False  # trains LoRA adapters (lora_rank) on a frozen base model
    mtp: bool = False  # builds and trains a checkpoint's multi-token-prediction layers (mtp_num_layers)
    # why it cannot build a model of this config.json in this layout ("" when it can)
    model_problem: Callable[..., str]
    # why it cannot replay a MoE model's routing / add its load-balancing loss in this layout ("" when it can)
    replay_problem: Callable[..., str]
    aux_loss_problem: Callable[..., str]
    # why it cannot split this model's sequences over CP ranks ("" when it can; `images`: a job with multimodal_keys)
    context_parallel_problem: Callable[..., str]
    # the Megatron load-balancing types it adds under moe_aux_loss_coeff (global_aux_loss counts the experts' tokens
    # over the data-parallel ranks and the step's micro-batches, which megatron-core's routers do)
    load_balancing_types: tuple[str, ...] = ("aux_loss", "seq_aux_loss", "global_aux_loss")


BACKENDS: dict[str, Capabilities] = {
    "fsdp": Capabilities(critic=True, packing=True, tensor_parallel=False, pipeline_parallel=False,
                         expert_parallel=False, context_parallel=True, extra_flags=False, reads_shares=True,
                         slime_checkpoints=False, vision=True, lora=True,
                         model_problem=families.fsdp_problem,
                         replay_problem=families.fsdp_replay_problem,
                         aux_loss_problem=families.fsdp_aux_loss_problem,
                         context_parallel_problem=families.fsdp_context_parallel_problem,
                         load_balancing_types=("aux_loss", "seq_aux_loss")),
    "megatron": Capabilities(critic=True, packing=True, tensor_parallel=True, pipeline_parallel=True,
                             expert_parallel=True, context_parallel=True, extra_flags=True, reads_shares=False,
                             slime_checkpoints=True, mtp=True, vision=True,
                             model_problem=families.megatron_problem,
                             replay_problem=families.megatron_replay_problem,
                             aux_loss_problem=families.megatron_train_mode_problem,
                             context_parallel_problem=families.megatron_context_parallel_problem),
}


def load_balancing_problem(train_backend: str, kind: str) -> str:
    """"" when `train_backend` adds the load-balancing loss `kind` (moe_router_load_balancing_type), else why not."""
    kinds = BACKENDS[train_backend].load_balancing_types if train_backend in BACKENDS else (kind,)
    if kind in kinds or kind == "none":
        return ""
    return (f"moe_router_load_balancing_type {kind}: train_backend {train_backend} adds {' or '.join(kinds)}; "
            f"{kind} is megatron-core's (train_backend megatron)")


def capabilities(name: str) -> Capabilities:
    """Backend `name`'s capabilities; InvalidArgument naming the backends there are when there is none."""
    if name not in BACKENDS:
        raise InvalidArgument(f"train_backend {name!r}: expected one of {', '.join(BACKENDS)}")
    return BACKENDS[name]


def backends_that(can: Callable[[Capabilities], Any]) -> list[str]:
    """The backends whose capabilities satisfy `can` (for messages naming what to choose instead)."""
    return [name for name, caps in BACKENDS.items() if can(caps)]


def backends_for(hf_config: dict[str, Any]) -> list[str]:
    """The backends that build this model (in their default layout)."""
    return backends_that(lambda caps: not caps.model_problem(hf_config))


def model_problem(train_backend: str, hf_config: dict[str, Any], *, tp_size: int = 1, pp_size: int = 1,
                  ep_size: int = 1, **layout: Any) -> str:
    """"" when `train_backend` builds hf_config's model (or the config does not say) in the layout tp_size ×
    pp_size with experts over ep_size ranks, else why not and which backend does."""
    if "model_type" not in hf_config or train_backend not in BACKENDS:
        return ""
    problem = BACKENDS[train_backend].model_problem(hf_config, tp_size=tp_size, pp_size=pp_size, ep_size=ep_size,
                                                    **layout)
    if not problem:
        return ""
    others = [name for name in backends_for(hf_config) if name != train_backend]
    instead = f"; train_backend {' or '.join(others)} trains it" if others else ""
    return (f"hf_checkpoint: train_backend {train_backend} cannot build model family "
            f"{families.family(hf_config)!r}: {problem}{instead}")


def router_problem(setting: str, train_backend: str, hf_config: dict[str, Any], *, tp_size: int = 1,
                   sequence_parallel: bool = False) -> str:
    """"" when `train_backend` applies the MoE router `setting` ("routing replay" or "moe_aux_loss_coeff") to
    hf_config's model at tensor_model_parallel_size tp_size (with or without Megatron's sequence_parallel), else why
    not."""
    check = {"routing replay": "replay_problem", "moe_aux_loss_coeff": "aux_loss_problem"}[setting]
    problem = getattr(BACKENDS[train_backend], check)(hf_config, tp_size=tp_size, sequence_parallel=sequence_parallel) \
        if train_backend in BACKENDS else ""
    return f"{setting}: train_backend {train_backend} {problem.removeprefix('it ')}" if problem.startswith("it ") else \
        f"{setting}: {problem}" if problem else ""
