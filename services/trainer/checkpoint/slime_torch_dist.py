"""slime's (Megatron-LM's) torch_dist checkpoints: `{root}/latest_checkpointed_iteration.txt` holding `release` or an
iteration, and `release/` or `iter_{N:07d}/` with megatron-core dist-checkpointing's files, the model's sharded
tensors under Megatron's own keys (no prefix). This reads a model's weights out of one, in any TP/PP layout.

Only the sharded tensors are read: Megatron-LM's common.pt holds pickled objects (its argparse Namespace) that a
trainer must not unpickle, and the model needs none of it. A checkpoint written with Transformer Engine's fused
layer norms (GPU) loads into the local spec (CPU) and back: the two key spellings of each norm are matched. slime's
own checkpoints of the gated delta-net families (`--spec slime_plugins.models.qwen3_5` / `qwen3_next`) hold each
such layer as transformers' module under `self_attention.` (`linear_attn.*` and its `input_layernorm.weight`): those
tensors are read whole and converted as HF weights are.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from services.common.errors import InvalidArgument
from services.trainer.checkpoint.safe_dcp import SafeFileSystemReader
from services.trainer.distributed import megatron_cpu
from services.trainer.models import qwen3_next
from services.trainer.models.arch import ModelArch

# the local spec's separate norms and Transformer Engine's, fused into the next linear layer
NORM_SPELLINGS = (("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
                  ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"))


# slime's HF-module gated delta-net layer: transformers' module and its input norm under the layer's self_attention.
SLIME_GDN = re.compile(r"decoder\.layers\.(\d+)\.self_attention\.(linear_attn\..+|input_layernorm\.weight)$")
LAYER = re.compile(r"decoder\.layers\.(\d+)\.")


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


def _slime_gdn_layers(saved: set[str]) -> set[int]:
    """The (global) layers a checkpoint holds as slime's HF-module gated delta-nets."""
    return {int(match.group(1)) for key in saved if (match := SLIME_GDN.match(key))}


def _slime_gdn_weights(path: Path, saved: set[str], layers: set[int], arch: ModelArch) -> dict[str, torch.Tensor]:
    """slime's gated delta-net tensors of `layers`, read whole, as this TP rank's shards under megatron-core's
    checkpoint keys (global layer numbers)."""
    import torch.distributed.checkpoint as dcp
    from megatron.core import parallel_state

    metadata = SafeFileSystemReader(path).read_metadata().state_dict_metadata
    wanted = {key: torch.empty(metadata[key].size, dtype=metadata[key].properties.dtype)
              for key in saved if (match := SLIME_GDN.match(key)) and int(match.group(1)) in layers}
    dcp.load(wanted, storage_reader=SafeFileSystemReader(path), no_dist=True)
    # the layer's tensors under transformers' names (model.layers.N.input_layernorm.weight, ...linear_attn.*)
    hf = {f"model.layers.{key.split('.')[2]}.{key.split('.self_attention.', 1)[1]}": tensor
          for key, tensor in wanted.items()}
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()

    def shard(tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return tensor.chunk(tp_size, dim=dim)[tp_rank].clone().contiguous()

    out: dict[str, torch.Tensor] = {}
    for layer in layers:
        src, dst = f"model.layers.{layer}.", f"decoder.layers.{layer}."
        missing = [name for name in ("input_layernorm.weight", "linear_attn.conv1d.weight") if src + name not in hf]
        if missing:
            raise InvalidArgument(f"checkpoint {path}: no tensor decoder.layers.{layer}.self_attention.{missing[0]}")
        try:
            out.update(qwen3_next.hf_to_megatron_linear_attention(hf, arch, src, dst, shard))
        except KeyError as exc:
            name = str(exc.args[0]).replace("model.layers.", "decoder.layers.").replace(".linear_attn.",
                                                                                       ".self_attention.linear_attn.")
            raise InvalidArgument(f"checkpoint {path}: no tensor {name}") from None
        out[dst + "input_layernorm.weight"] = hf[src + "input_layernorm.weight"]  # (the backend builds these locally)
    return out


def load_model(gpt: Any, path: str | Path, arch: ModelArch | None = None) -> None:
    """Collective: the weights of the Megatron checkpoint directory `path` (release/ or iter_N/) into `gpt` (of the
    architecture `arch`, which a checkpoint of slime's HF-module gated delta-nets needs); a tensor the checkpoint
    lacks under both spellings fails naming it."""
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
    slime_layers = _slime_gdn_layers(saved) if arch is not None and arch.linear_attention is not None else set()
    from_slime: dict[str, str] = {}  # state-dict key -> checkpoint key, of the tensors slime's gated delta-nets give
    missing = []
    for name, tensor in sharded.items():
        key = getattr(tensor, "key", None)
        if key is None or key in saved or key.endswith("_extra_state"):
            continue
        if (layer := LAYER.match(key)) and int(layer.group(1)) in slime_layers:
            from_slime[name] = key
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
    for name in [*from_slime, *(name for name in sharded if name.endswith("_extra_state"))]:
        del sharded[name]  # (extra states are never loaded: slime's HF-module layers have none of ours)
    with megatron_cpu.cuda_to_cpu():
        loaded = dist_checkpointing.load(sharded, str(path), common_strategy=WeightsOnly())
    if from_slime:
        stage_layers = {int(LAYER.match(key).group(1)) for key in from_slime.values()}  # this rank's only
        converted = _slime_gdn_weights(path, saved, stage_layers, arch)
        # (megatron-core keys a local-spec input norm as Transformer Engine's fused one)
        converted.update({twin: t for key, t in list(converted.items()) if (twin := _twin(key)) is not None})
        if lacking := sorted(key for key in from_slime.values() if key not in converted):
            raise InvalidArgument(f"checkpoint {path}: no tensor {', '.join(lacking[:5])} (a checkpoint of "
                                  "another architecture?)")
        loaded.update({name: converted[key] for name, key in from_slime.items()})
    result = gpt.load_state_dict({k: v for k, v in loaded.items() if not k.endswith("_extra_state")}, strict=False)
    if left := [k for k in result.missing_keys if not k.endswith("_extra_state")]:
        raise InvalidArgument(f"checkpoint {path}: loaded no value for {', '.join(left[:5])}")
