"""Float32 parameters are their own main parameters under megatron-core's distributed optimizer: each shard it steps
is a view of the model parameter, itself a view of DDP's parameter buffer, so after every step
`_copy_main_params_to_model_params` copies each shard onto itself (every float32 weight read and written once more a
step). Where every shard is that view of its buffer, the copy is skipped; where any is not (bf16's float32 copies,
FP8, megatron-FSDP, the precision-aware optimizer), megatron-core's copy runs.
"""

from __future__ import annotations

import functools

ALIASED = "_main_params_are_model_params"  # on the optimizer: the check's answer, taken once (buffers stay put)


@functools.cache
def apply() -> None:
    """Wrap DistributedOptimizer._copy_main_params_to_model_params; idempotent."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    copy = DistributedOptimizer._copy_main_params_to_model_params

    @functools.wraps(copy)
    def copy_unless_aliased(self) -> None:
        if not main_params_are_model_params(self):
            copy(self)

    DistributedOptimizer._copy_main_params_to_model_params = copy_unless_aliased


def main_params_are_model_params(optimizer) -> bool:
    """Whether every shard `optimizer` steps is the very memory its parameter buffer's copy would write."""
    aliased = getattr(optimizer, ALIASED, None)
    if aliased is None:
        aliased = _aliased(optimizer)
        setattr(optimizer, ALIASED, aliased)
    return aliased


def _aliased(optimizer) -> bool:
    from megatron.core.fp8_utils import is_float8tensor

    if optimizer.is_stub_optimizer or optimizer.ddp_config.use_megatron_fsdp or \
            optimizer.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 or \
            any(group for group in optimizer.shard_fp32_from_float16_groups):
        return False
    for shards, params in zip(optimizer.shard_fp32_groups, optimizer.model_fp32_groups, strict=True):
        for shard, param in zip(shards, params, strict=True):
            if is_float8tensor(param):
                return False
            world_range = optimizer._get_model_param_range_map(param)["gbuf_world_in_bucket"]
            buffer_index, _, bucket = optimizer.model_param_gbuf_map[param]
            target = optimizer.buffers[buffer_index].buckets[bucket].param_data.view(-1)[
                world_range.start:world_range.end]
            if (target.data_ptr(), target.numel(), target.dtype) != (shard.data_ptr(), shard.numel(), shard.dtype):
                return False
    return True
