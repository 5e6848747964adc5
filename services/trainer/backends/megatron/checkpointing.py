"""MegatronBackend's checkpoints: megatron-core dist-checkpointing. Each rank writes its shards of global tensors: the
models load into another TP/PP/DP layout, the distributed optimizer's state into another DP size only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from services.common.errors import InvalidArgument
from services.trainer.backends.megatron import cpu_compat

# Megatron-LM's default layout of the distributed optimizer's state: each rank's buffers as they are (no gather);
# a load may change the data-parallel size only.
OPTIM_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


class MegatronCheckpointing:
    """Mixin of MegatronBackend: the checkpoint half of `TrainBackend` (its gpt, ref_model, optimizer, step count
    and weight version are the backend's)."""

    checkpoint_format = "mcore"  # the directory of this backend's state inside iter_N/

    def checkpoint_parts(self) -> set[str]:
        """What a checkpoint of this backend holds: model and optim (the policy and its optimizer), ref_model."""
        return {"model", "optim"} | ({"ref_model"} if self.ref_model is not None else set())

    def _sharded_state_dict(self, parts: set[str], *, loading: bool) -> dict[str, Any]:
        model = self.gpt.sharded_state_dict(prefix="model.")
        state: dict[str, Any] = {"model": model} if "model" in parts else {}
        if "optim" in parts:
            self._init_optimizer_state()
            with cpu_compat.cuda_to_cpu():
                state["optim"] = self.optimizer.sharded_state_dict(model, is_loading=loading, metadata=OPTIM_METADATA)
        if "ref_model" in parts:
            state["ref_model"] = self.ref_model.sharded_state_dict(prefix="ref_model.")
        return state

    def _init_optimizer_state(self) -> None:
        """Allocate a fresh torch Adam's state as it would itself (step 0, zero moments; its next update is a
        fresh Adam's): Megatron's state dict reads the step count off that state, which torch creates only at the
        first step (TE's and Apex's Adam keep it elsewhere)."""
        for optimizer in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            inner = optimizer.optimizer
            if not isinstance(inner, torch.optim.Adam):
                continue
            for group in inner.param_groups:
                for param in group["params"]:
                    if not inner.state[param]:
                        inner.state[param].update(step=torch.tensor(0.0, device="cpu"), exp_avg=torch.zeros_like(param),
                                                  exp_avg_sq=torch.zeros_like(param))

    def _set_adam_steps(self, num_steps: int) -> None:
        """Each parameter's Adam step count (its bias correction), one tensor each. megatron-core 0.16 restores it
        wrongly for torch's Adam: the distributed optimizer overwrites the loaded count with the fresh one (it
        keeps it out of the checkpoint's tensors) and shares one tensor among all parameters (incremented once
        per parameter per step). Every optimizer step of this backend steps every parameter, so each count is
        the backend's step count."""
        for optimizer in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            inner = optimizer.optimizer
            if isinstance(inner, torch.optim.Adam):
                for state in inner.state.values():
                    state["step"] = torch.tensor(float(num_steps), device="cpu")

    def save_sharded(self, path: str | Path) -> None:
        """Collective: write the checkpoint's parts, the lr schedule's step count and the weight version."""
        from megatron.core import dist_checkpointing

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        parts = self.checkpoint_parts()
        state = {**self._sharded_state_dict(parts, loading=False), "parts": sorted(parts),
                 "num_steps": self._num_steps, "weight_version": self._weight_version}
        with cpu_compat.cuda_to_cpu():
            dist_checkpointing.save(state, str(path), sharded_strategy=_save_strategy())

    def load_sharded(self, path: str | Path, parts: set[str] | None = None) -> set[str]:
        """Collective: load the parts of a checkpoint (default: all that both it and this backend have); returns
        the parts loaded. The others keep their current values."""
        from megatron.core import dist_checkpointing

        path = Path(path)
        saved = set(dist_checkpointing.load_common_state_dict(str(path))["parts"])
        wanted = self.checkpoint_parts() & saved & (parts if parts is not None else saved)
        if "optim" in wanted and "model" not in wanted:
            raise InvalidArgument(f"checkpoint {path}: an optimizer loads only with its model")
        with cpu_compat.cuda_to_cpu():
            loaded = dist_checkpointing.load(self._sharded_state_dict(wanted, loading=True), str(path))
        if "model" in wanted:
            self.gpt.load_state_dict(_strip(loaded["model"], "model."))
        if "optim" in wanted:
            with torch.no_grad(), cpu_compat.cuda_to_cpu():  # the main params are views of the model's
                self.optimizer.load_state_dict(loaded["optim"])
            self._num_steps = int(loaded["num_steps"])
            self._set_adam_steps(self._num_steps)
        if "ref_model" in wanted:
            self.ref_model.load_state_dict(_strip(loaded["ref_model"], "ref_model."))
        if parts is None:
            self._weight_version = int(loaded["weight_version"])
        return wanted

    def load_ref_sharded(self, path: str | Path) -> None:
        """Collective: the policy of a checkpoint as the reference model (slime's --ref-load of a checkpoint)."""
        if self.ref_model is None:
            raise InvalidArgument("ref_load: this job has no reference model (use_kl_loss or kl_coef)")
        _load_policy_into(self.ref_model, path)

    def load_teacher_sharded(self, path: str | Path) -> None:
        """Collective: the policy of a checkpoint as the distillation teacher (slime's --opd-teacher-load)."""
        if self.teacher_model is None:
            raise InvalidArgument("opd_teacher_load: this job has no teacher model (use_opd with opd_type megatron)")
        _load_policy_into(self.teacher_model, path)


def _load_policy_into(gpt, path: str | Path) -> None:
    """The policy ("model.") of a checkpoint into a frozen model of the same architecture, in any TP/PP layout."""
    from megatron.core import dist_checkpointing

    with cpu_compat.cuda_to_cpu():
        loaded = dist_checkpointing.load({"model": gpt.sharded_state_dict(prefix="model.")}, str(path))
    gpt.load_state_dict(_strip(loaded["model"], "model."))


def _strip(state: dict[str, Any], prefix: str) -> dict[str, Any]:
    """A loaded sharded state dict's keys as the module's own state-dict keys."""
    return {key.removeprefix(prefix): value for key, value in state.items()}


def _save_strategy():
    """Megatron's torch_dist format (DCP files plus metadata.json), written synchronously by this process: its own
    strategy forks writer processes and spawns a queue manager, which a trainer serving gRPC must not do."""
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )

    class SyncTorchDistSave(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir) -> None:
            state, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
            dcp.save(mcore_to_pyt_state_dict(state, False),
                     storage_writer=dcp.FileSystemWriter(str(checkpoint_dir), thread_count=1),
                     planner=MCoreSavePlanner(dedup_replicated_tensors=not self.keep_only_main_replica,
                                              flatten_state_dict=False))

    return SyncTorchDistSave("torch_dist", 1)
