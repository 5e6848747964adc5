"""Optimizer state off the GPU: megatron-core's HybridDeviceOptimizer under the distributed optimizer.

megatron-core 0.16's DistributedOptimizer shards a float32 parameter as `model_param.view(-1)[start:end]`, a view
that autograd tracks (not detached, unlike its bf16 shards). Its plain Adam takes the shards by assigning
`param_groups`, which never checks them; the hybrid optimizer is rebuilt through torch's `Optimizer.__init__`, whose
`add_param_group` refuses a non-leaf tensor ("can't optimize a non-leaf Tensor"). `leaf_fp32_shards()` makes those
shards detached views of the same storage while the optimizer is built: the same memory, updated in place as before.
With the offload, megatron-core runs `use_precision_aware_optimizer` on the hybrid optimizer (no TransformerEngine
needed), but its config check first compares TransformerEngine's version, None when it is absent
(`config_without_te()`). Loading a checkpoint into it (`apply()`): the hybrid optimizer copies each loaded master
parameter into its float32 copy, which only a bf16 parameter has; a float32 parameter's is its host copy (or itself).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

# Megatron-LM's --optimizer-offload-fraction default (megatron-core's OptimizerConfig defaults to 0: nothing moves)
OFFLOAD_FRACTION = 1.0


def optimizer_fields(overrides: dict[str, Any]) -> dict[str, Any]:
    """The OptimizerConfig fields that offloading implies: Megatron-LM's whole-state offload unless the fraction is
    given, and decoupled weight decay (the only kind megatron-core offloads; the backend's Adam already is AdamW)."""
    if not overrides.get("optimizer_cpu_offload"):
        return {}
    return {"optimizer_offload_fraction": overrides.get("optimizer_offload_fraction", OFFLOAD_FRACTION)}


@functools.cache
def apply() -> None:
    """Loading a checkpoint into the hybrid optimizer of a float32 model: each master parameter goes where the
    optimizer steps that parameter (megatron-core 0.16 looks for a bf16 parameter's float32 copy only); idempotent."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    def update_fp32_params_by_new_state(self) -> None:
        if not self.param_update_in_fp32:
            return
        for param, state in self.state.items():
            inner = self.param_to_fp32_param.get(param, self.gpu_params_map_cpu_copy.get(param))
            if inner is not None and "master_param" in state and inner is not state["master_param"]:
                inner.data.copy_(state["master_param"])

    HybridDeviceOptimizer._update_fp32_params_by_new_state = update_fp32_params_by_new_state


@contextlib.contextmanager
def config_without_te() -> Iterator[None]:
    """While an OptimizerConfig is built: without TransformerEngine, "TransformerEngine >= v" is False rather than a
    TypeError (megatron-core compares None with a version)."""
    from megatron.core.optimizer import optimizer_config
    from megatron.core.utils import get_te_version

    check = optimizer_config.is_te_min_version
    if get_te_version() is None:
        optimizer_config.is_te_min_version = lambda version, check_equality=True: False
    try:
        yield
    finally:
        optimizer_config.is_te_min_version = check


@contextlib.contextmanager
def leaf_fp32_shards() -> Iterator[None]:
    """While megatron-core builds a DistributedOptimizer, its float32 parameter shards are leaf tensors."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer.__dict__["_build_model_and_main_param_groups"]

    def build(cls, gbuf_ranges, param_gbuf_map, opt_group_ranges, config):
        groups = original.__func__(cls, gbuf_ranges, param_gbuf_map, opt_group_ranges, config)
        shard_fp32_groups = groups[3]
        leaves: dict[int, torch.Tensor] = {}
        for shards in shard_fp32_groups:
            for i, shard in enumerate(shards):
                if shard is not None and not shard.is_leaf:
                    shards[i] = leaves[id(shard)] = _detached_like(shard)
        for group_range in opt_group_ranges:
            params = group_range["orig_group"]["params"]
            group_range["orig_group"]["params"] = [leaves.get(id(p), p) for p in params]
        return groups

    DistributedOptimizer._build_model_and_main_param_groups = classmethod(build)
    try:
        yield
    finally:
        DistributedOptimizer._build_model_and_main_param_groups = original


def _detached_like(shard: torch.Tensor) -> torch.Tensor:
    """`shard` detached (the same storage), with the attributes megatron-core reads off a shard (its TP marks,
    `shared`)."""
    from megatron.core import tensor_parallel

    leaf = shard.detach()
    tensor_parallel.copy_tensor_model_parallel_attributes(leaf, shard)
    if hasattr(shard, "shared"):
        leaf.shared = shard.shared
    return leaf
