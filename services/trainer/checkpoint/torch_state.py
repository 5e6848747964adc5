"""The torch backend's state: HF checkpoints loaded into the policy or the reference, and the state by part (policy,
optimizer, reference, critic, weight version) as torch's distributed-checkpoint state dicts, which `DCPCheckpointing`
saves and loads, each rank its own shards under FSDP."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from services.common.errors import InvalidArgument
from services.trainer.batching import varlen
from services.trainer.checkpoint.dcp import DCPCheckpointing
from services.trainer.distributed import parallel
from services.trainer.models import families


def load_causal_lm(path: Path, *, images: bool = False):
    """An HF causal LM in float32, in eval mode, its attention able to take packed rows; a vision-language checkpoint
    (`families.is_vision_language`; for a job with `images` a Qwen3.5 one too) as its whole model
    (...ForConditionalGeneration) with the vision tower."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    try:
        config_path = path / "config.json"
        hf_config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        whole = families.is_vision_language(hf_config, images=images)
        model_class = AutoModelForImageTextToText if whole else AutoModelForCausalLM
        model = model_class.from_pretrained(path, dtype=torch.float32)
    except (OSError, ValueError) as err:
        raise InvalidArgument(f"model {path}: cannot load a causal LM ({err})") from err
    varlen.use_in(model)  # packed rows take varlen flash attention where it applies
    # No dropout: the training forward, the no-grad recompute and the engines see the same policy.
    return model.eval()


class TorchStateDicts(DCPCheckpointing):
    """Needs `config`, `model`, `optimizer`, `ref_model`, `critic` (None or with `.model`, `.optimizer`), `world`,
    `_weight_version` and `_make_optimizer`."""

    config: Any  # the TrainConfig
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    ref_model: torch.nn.Module | None
    teacher_model: torch.nn.Module | None
    critic: Any
    world: parallel.World
    _weight_version: int

    def _make_optimizer(self) -> torch.optim.Optimizer:
        raise NotImplementedError

    def _load_hf_model(self, path: str | Path) -> torch.nn.Module:
        """An HF checkpoint as the policy's architecture (the whole vision-language model for a job with images)."""
        return load_causal_lm(Path(path), images=bool(self.config.multimodal_keys))

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
                options = self._model_state_options(model)
                out[name] = get_model_state_dict(model, options=options)
                if options is not None:  # a tied weight (lm_head under tied embeddings) escapes ignore_frozen_params
                    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
                    out[name] = {n: t for n, t in out[name].items() if n in trainable}
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
                set_model_state_dict(model, state[name], options=self._model_state_options(model))
            if optim in state:
                set_optimizer_state_dict(model, optimizer, state[optim])
        if "weight_version" in state:
            self._weight_version = int(state["weight_version"])

    def _model_state_options(self, model: torch.nn.Module):
        """A LoRA policy's checkpoint holds its adapters alone: the frozen base is the HF checkpoint it loads."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        if model is self.model and self.config.lora:
            return StateDictOptions(ignore_frozen_params=True, strict=False)
        return None

    def _checkpoint_parts(self) -> list[tuple[str, str, torch.nn.Module | None, torch.optim.Optimizer | None]]:
        """(model part, optimizer part, model, optimizer) of every model a checkpoint holds."""
        parts = [("model", "optim", self.model, self.optimizer), ("ref_model", "", self.ref_model, None)]
        if self.critic is not None:
            parts.append(("critic", "critic_optim", self.critic.model, self.critic.optimizer))
        return parts

    def load(self, path: str | Path) -> None:
        """Replace the policy's weights with an HF checkpoint's, with fresh optimizer state (the reference stays);
        under LoRA the base's weights, the adapters kept. Every rank calls it (each reads the directory)."""
        state = self._load_hf_model(path).state_dict()
        if self.config.lora and (unknown := [name for name in state if name not in self.model.state_dict()]):
            raise InvalidArgument(f"checkpoint {path}: {len(unknown)} weights the LoRA policy's base does not have "
                                  f"(e.g. {unknown[0]})")
        parallel.load_full_state_dict(self.model, state, self.world, strict=not self.config.lora)
        self.optimizer = self._make_optimizer()

    def load_ref(self, path: str | Path) -> None:
        """Replace the reference model's weights with an HF checkpoint's (slime's --ref-load)."""
        if self.ref_model is None:
            raise InvalidArgument("ref_load: this job has no reference model (use_kl_loss or kl_coef)")
        parallel.load_full_state_dict(self.ref_model, self._load_hf_model(path).state_dict(), self.world)

    def load_teacher(self, path: str | Path) -> None:
        """Replace the distillation teacher's weights with an HF checkpoint's (the policy's architecture)."""
        if self.teacher_model is None:
            raise InvalidArgument("opd_teacher_load: this job has no teacher model (use_opd with opd_type megatron)")
        parallel.load_full_state_dict(self.teacher_model, self._load_hf_model(path).state_dict(), self.world)

    def load_megatron_checkpoint(self, path: str | Path, into: str) -> None:
        raise InvalidArgument(f"checkpoint {path}: a slime (Megatron) torch_dist checkpoint loads on train_backend "
                              "megatron; this backend reads its HF copy (the driver's slime_checkpoint_conversion, or "
                              "python -m services.trainer.driver.slime_to_hf)")

    def load_teacher_sharded(self, path: str | Path) -> None:
        """The policy of a checkpoint's dcp/ directory as the teacher."""
        self._load_policy_into(self.teacher_model, path)
