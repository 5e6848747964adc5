"""slime's (Megatron-LM's) torch_dist checkpoints: `{root}/latest_checkpointed_iteration.txt` holding `release` or an
iteration, and `release/` or `iter_{N:07d}/` with megatron-core dist-checkpointing's files, the model's sharded
tensors under Megatron's own keys (no prefix). This reads a model's weights out of one, in any TP/PP layout.

Only the sharded tensors are read: Megatron-LM's common.pt holds pickled objects (its argparse Namespace) that a
trainer must not unpickle, and the model needs none of it. A checkpoint written with Transformer Engine's fused
layer norms (GPU) loads into the local spec (CPU) and back: the two key spellings of each norm are matched.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.common.errors import InvalidArgument
from services.trainer.checkpoint.safe_dcp import SafeFileSystemReader
from services.trainer.distributed import megatron_cpu

# the local spec's separate norms and Transformer Engine's, fused into the next linear layer
NORM_SPELLINGS = (("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
                  ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"))


def _twin(key: str) -> str | None:
    for local, te in NORM_SPELLINGS:
        if key.endswith(local):
            return key[: -len(local)] + te
        if key.endswith(te):
            return key[: -len(te)] + local
    return None


def checkpoint_keys(path: Path) -> set[str]:
    """The tensor keys a dist-checkpoint directory holds (its DCP metadata, read without running pickled code)."""
    try:
        return set(SafeFileSystemReader(path).read_metadata().state_dict_metadata)
    except FileNotFoundError:
        raise InvalidArgument(f"checkpoint {path}: no torch_dist metadata (.metadata)") from None


def load_model(gpt: Any, path: str | Path) -> None:
    """Collective: the weights of the Megatron checkpoint directory `path` (release/ or iter_N/) into `gpt`; a
    tensor the checkpoint lacks under both spellings fails naming it."""
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    class WeightsOnly(TorchCommonLoadStrategy):
        def load_common(self, checkpoint_dir):
            return {}

    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    path = Path(path)
    saved = checkpoint_keys(path)
    # the data-parallel group named: GPTModel ties a last stage's MTP embedding copy to the first stage's key with it
    sharded = gpt.sharded_state_dict(prefix="", metadata={
        "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)})
    missing = []
    for tensor in sharded.values():
        key = getattr(tensor, "key", None)
        if key is None or key in saved or key.endswith("_extra_state"):
            continue
        # a factory's tensor is saved as its named parts (a gated delta-net's in_proj.weight.query, ...)
        if isinstance(tensor, ShardedTensorFactory) and any(name.startswith(key + ".") for name in saved):
            continue
        if (twin := _twin(key)) in saved:
            tensor.key = twin
        else:
            missing.append(key)
    if missing:
        raise InvalidArgument(f"checkpoint {path}: no tensor {', '.join(sorted(missing)[:5])} (a checkpoint of "
                              "another architecture?)")
    with megatron_cpu.cuda_to_cpu():
        loaded = dist_checkpointing.load(sharded, str(path), common_strategy=WeightsOnly())
    result = gpt.load_state_dict({k: v for k, v in loaded.items() if not k.endswith("_extra_state")}, strict=False)
    if left := [k for k in result.missing_keys if not k.endswith("_extra_state")]:
        raise InvalidArgument(f"checkpoint {path}: loaded no value for {', '.join(left[:5])}")
