"""MegatronBackend's checkpoints: megatron-core dist-checkpointing in Megatron-LM's own torch_dist layout, so slime (and
Megatron-LM) load them back with `--load`. Each rank writes its shards of global tensors: the models load into another
TP/PP/DP layout, the distributed optimizer's state into another DP size only.

What Megatron-LM's save_checkpoint writes and its load_checkpoint reads: `model` (the GPT's sharded tensors under
Megatron's keys, no prefix), `optimizer` (its sharded state, under Megatron-LM's content metadata),
`opt_param_scheduler` (the lr schedule in samples, as slime sizes it), `iteration` (the rollout id),
`checkpoint_version` and `args` (the layout and architecture Megatron-LM checks). Physarum's own parts sit beside
them: `ref_model` (prefixed keys), `parts`, `num_steps`, `weight_version`. RNG states are Physarum's per-rank files
(`args.no_save_rng` tells Megatron-LM so)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from services.common.errors import InvalidArgument
from services.trainer.distributed import megatron_cpu

# Megatron-LM's content metadata (its default: the distributed optimizer's buffers as they are, no gather; a load may
# change the data-parallel size only, and needs DDP's bucketing: both sides bucket alike without overlap_grad_reduce),
# saved with the checkpoint: Megatron-LM builds its load request from it. (fully_reshardable, free of the bucketing,
# fails in megatron-core 0.16 with torch's Adam: its load copies a `step` the checkpoint lacks.)
CONTENT_METADATA = {"distrib_optim_sharding_type": "dp_reshardable", "singleton_local_shards": False,
                    "chained_optim_avoid_prefix": True}
CHECKPOINT_VERSION = 3.0  # Megatron-LM's: QKV in its current order


class MegatronCheckpointing:
    """Mixin of MegatronBackend: the checkpoint half of `TrainBackend` (its gpt, ref_model, optimizer, step count
    and weight version are the backend's)."""

    checkpoint_format = "torch_dist"  # Megatron-LM's layout: the state lives in iter_N/ itself

    def checkpoint_parts(self) -> set[str]:
        """What a checkpoint of this backend holds: model and optim (the policy and its optimizer), ref_model, critic
        and critic_optim (PPO's value model and its optimizer)."""
        return {"model", "optim"} | ({"ref_model"} if self.ref_model is not None else set()) | \
            ({"critic", "critic_optim"} if self.critic is not None else set())

    def _sharded_state_dict(self, parts: set[str], *, loading: bool) -> dict[str, Any]:
        """Megatron-LM's generate_state_dict for these parts: the same keys and metadata, so either side reads
        what the other wrote."""
        from megatron.core import parallel_state as ps

        metadata = {**CONTENT_METADATA, "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
        model = self.gpt.sharded_state_dict(metadata=metadata)
        state: dict[str, Any] = {"model": model} if "model" in parts else {}
        if "optim" in parts:
            self._init_optimizer_state()
            with megatron_cpu.cuda_to_cpu():
                state["optimizer"] = self.optimizer.sharded_state_dict(model, is_loading=loading, metadata=metadata)
        if "ref_model" in parts:
            state["ref_model"] = self.ref_model.sharded_state_dict(prefix="ref_model.", metadata=metadata)
        if "critic" in parts:
            state["critic"] = self.critic.gpt.sharded_state_dict(prefix="critic.", metadata=metadata)
        if "critic_optim" in parts:
            with megatron_cpu.cuda_to_cpu():
                state["critic_optimizer"] = _renamed(self.critic.optimizer.sharded_state_dict(
                    state["critic"], is_loading=loading, metadata=metadata), "optimizer.", "critic_optimizer.")
        return state

    def _megatron_lm_common(self, rollout_id: int) -> dict[str, Any]:
        """The non-tensor entries Megatron-LM's load_checkpoint reads: the iteration (slime resumes at rollout_id + 1),
        the lr schedule (slime's OptimizerParamScheduler counts samples and checks these against its own flags) and
        the args it compares with the run's (layout and architecture)."""
        cfg, arch = self.config, self.arch
        samples_per_step = cfg.global_batch_size or 1
        args = argparse.Namespace(
            num_layers=arch.num_layers, hidden_size=arch.hidden_size, num_attention_heads=arch.num_attention_heads,
            tensor_model_parallel_size=self.tp_size, pipeline_model_parallel_size=self.pp_size,
            expert_model_parallel_size=self.ep_size, data_parallel_size=self.dp_size,
            world_size=self.tp_size * self.pp_size * self.dp_size, ckpt_format="torch_dist",
            use_distributed_optimizer=self.use_distributed_optimizer, no_save_optim=False, no_save_rng=True,
            consumed_train_samples=self._num_steps * samples_per_step)
        scheduler = {"max_lr": cfg.lr, "min_lr": cfg.min_lr, "lr_warmup_steps": cfg.lr_warmup_iters * samples_per_step,
                     "lr_decay_steps": (cfg.lr_decay_iters or 0) * samples_per_step,
                     "lr_decay_style": cfg.lr_decay_style, "num_steps": self._num_steps * samples_per_step}
        return {"iteration": rollout_id, "checkpoint_version": CHECKPOINT_VERSION, "args": args,
                "opt_param_scheduler": scheduler}

    def _optimizers(self) -> list[Any]:
        return [self.optimizer] + ([self.critic.optimizer] if self.critic is not None else [])

    def _torch_adams(self, optimizer: Any) -> list[torch.optim.Adam]:
        """The torch Adams that hold the state: megatron-core's own, or the hybrid optimizer's (offloaded state)."""
        from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

        adams = []
        for part in getattr(optimizer, "chained_optimizers", [optimizer]):
            inner = part.optimizer
            subs = inner.sub_optimizers if isinstance(inner, HybridDeviceOptimizer) else [inner]
            adams += [sub for sub in subs if isinstance(sub, torch.optim.Adam)]
        return adams

    def _init_optimizer_state(self) -> None:
        """Allocate a fresh torch Adam's state as it would itself (step 0, zero moments; its next update is a
        fresh Adam's): Megatron's state dict reads the step count off that state, which torch creates only at the
        first step (TE's and Apex's Adam keep it elsewhere). The hybrid optimizer shows its Adams' state as its own."""
        from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

        for inner in (adam for optimizer in self._optimizers() for adam in self._torch_adams(optimizer)):
            for group in inner.param_groups:
                for param in group["params"]:
                    if not inner.state[param]:
                        inner.state[param].update(step=torch.tensor(0.0, device="cpu"), exp_avg=torch.zeros_like(param),
                                                  exp_avg_sq=torch.zeros_like(param))
        for chained in self._optimizers():
            for optimizer in getattr(chained, "chained_optimizers", [chained]):
                if isinstance(optimizer.optimizer, HybridDeviceOptimizer):
                    optimizer.optimizer._sync_sub_optimizers_state_to_hdo()

    def _set_adam_steps(self, optimizer: Any, num_steps: int) -> None:
        """Each parameter's Adam step count (its bias correction), one tensor each. megatron-core 0.16 restores it
        wrongly for torch's Adam: the distributed optimizer overwrites the loaded count with the fresh one (it
        keeps it out of the checkpoint's tensors) and shares one tensor among all parameters (incremented once
        per parameter per step). Every optimizer step of this backend steps every parameter, so each count is
        the backend's step count."""
        for inner in self._torch_adams(optimizer):
            for state in inner.state.values():
                state["step"] = torch.tensor(float(num_steps), device="cpu")

    def save_sharded(self, path: str | Path, rollout_id: int = 0) -> None:
        """Collective: write the checkpoint's parts, the lr schedule's step count and the weight version, with what
        Megatron-LM needs to resume from it at `rollout_id` + 1."""
        from megatron.core import dist_checkpointing

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        parts = self.checkpoint_parts()
        state = {**self._sharded_state_dict(parts, loading=False), **self._megatron_lm_common(rollout_id),
                 "parts": sorted(parts), "num_steps": self._num_steps, "weight_version": self._weight_version,
                 **({"critic_num_steps": self.critic.num_steps} if self.critic is not None else {})}
        with megatron_cpu.cuda_to_cpu():
            dist_checkpointing.save(state, str(path), sharded_strategy=_save_strategy(),
                                    content_metadata=dict(CONTENT_METADATA))

    def load_sharded(self, path: str | Path, parts: set[str] | None = None) -> set[str]:
        """Collective: load the parts of a checkpoint (default: all that both it and this backend have); returns
        the parts loaded. The others keep their current values."""
        from megatron.core import dist_checkpointing

        path = Path(path)
        saved = set(dist_checkpointing.load_common_state_dict(str(path))["parts"])
        wanted = self.checkpoint_parts() & saved & (parts if parts is not None else saved)
        if ("optim" in wanted and "model" not in wanted) or ("critic_optim" in wanted and "critic" not in wanted):
            raise InvalidArgument(f"checkpoint {path}: an optimizer loads only with its model")
        with megatron_cpu.cuda_to_cpu():
            loaded = dist_checkpointing.load(self._sharded_state_dict(wanted, loading=True), str(path))
        if "model" in wanted:
            self.gpt.load_state_dict(loaded["model"])
        if "optim" in wanted:
            with torch.no_grad(), megatron_cpu.cuda_to_cpu():  # the main params are views of the model's
                self.optimizer.load_state_dict(loaded["optimizer"])
            self._num_steps = int(loaded["num_steps"])
            self._set_adam_steps(self.optimizer, self._num_steps)
        if "ref_model" in wanted:
            self.ref_model.load_state_dict(_strip(loaded["ref_model"], "ref_model."))
        if "critic" in wanted:
            self.critic.gpt.load_state_dict(_strip(loaded["critic"], "critic."))
        if "critic_optim" in wanted:
            with torch.no_grad(), megatron_cpu.cuda_to_cpu():
                self.critic.optimizer.load_state_dict(loaded["critic_optimizer"])
            self.critic.num_steps = int(loaded["critic_num_steps"])
            self._set_adam_steps(self.critic.optimizer, self.critic.num_steps)
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
    """The policy (Megatron's keys) of a checkpoint into a frozen model of the same architecture, in any TP/PP
    layout."""
    from megatron.core import dist_checkpointing

    with megatron_cpu.cuda_to_cpu():
        loaded = dist_checkpointing.load({"model": gpt.sharded_state_dict()}, str(path))
    gpt.load_state_dict(loaded["model"])


def _renamed(sharded: dict[str, Any], old: str, new: str) -> dict[str, Any]:
    """`sharded` with the checkpoint keys that begin with `old` beginning with `new` instead (a second optimizer's
    keys would be the policy optimizer's); in place, other keys as they are."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory
    from megatron.core.dist_checkpointing.utils import dict_list_map_inplace

    def rename(x):
        if isinstance(x, (ShardedTensor, ShardedTensorFactory, ShardedObject)) and x.key.startswith(old):
            x.key = new + x.key[len(old):]
        return x

    dict_list_map_inplace(rename, sharded)
    return sharded


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
