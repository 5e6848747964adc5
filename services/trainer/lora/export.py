"""A LoRA model's weights outward: PEFT's adapter directory (adapter_config.json + adapter_model.safetensors with
PEFT's key names), and the merged weights W + (alpha / r) · B @ A under the base model's HF names (what the engines
load until they serve adapters, and the merged HF export). All on a full (gathered) state dict."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

PEFT_PREFIX = "base_model.model."  # PEFT's LoraModel wraps the HF model as base_model.model
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_LORA_KEYS = (".lora_A.weight", ".lora_B.weight")


def is_adapter_key(name: str) -> bool:
    return name.endswith(_LORA_KEYS)


def merged_state_dict(state: dict[str, torch.Tensor], *, scaling: float) -> dict[str, torch.Tensor]:
    """The base model's weights with each adapter merged in (W + scaling · B @ A, in W's dtype), lora keys dropped."""
    out = {name: t for name, t in state.items() if not is_adapter_key(name)}
    for name, a in state.items():
        if name.endswith(".lora_A.weight"):
            module = name.removesuffix(".lora_A.weight")
            b = state[f"{module}.lora_B.weight"]
            weight = out[f"{module}.weight"]
            delta = (b.float() @ a.float()) * scaling
            out[f"{module}.weight"] = (weight.float() + delta.to(weight.device)).to(weight.dtype)
    return out


def peft_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter's tensors under PEFT's names (base_model.model.<module>.lora_A.weight, default adapter)."""
    return {PEFT_PREFIX + name: t.detach().contiguous() for name, t in state.items() if is_adapter_key(name)}


def save_peft_adapter(path: Path, state: dict[str, torch.Tensor], *, rank: int, alpha: float, dropout: float,
                      target_modules: Sequence[str], base_model: str) -> None:
    """Write PEFT's adapter directory for `state` (a full state dict of the LoRA model) at `path`."""
    write_peft_dir(path, peft_state_dict(state), peft_config(rank=rank, alpha=alpha, dropout=dropout,
                                                             target_modules=target_modules, base_model=base_model))


def peft_config(*, rank: int, alpha: float, dropout: float, target_modules: Sequence[str], base_model: str) -> dict:
    """PEFT's adapter_config.json of a LoRA adapter."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "r": rank,
            "lora_alpha": alpha, "lora_dropout": dropout, "target_modules": sorted(target_modules),
            "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "modules_to_save": None,
            "use_rslora": False, "init_lora_weights": True}


def write_peft_dir(path: Path, tensors: dict[str, torch.Tensor], config: dict) -> None:
    """PEFT's adapter directory at `path` from tensors already under PEFT's names."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file({name: t.detach().cpu().contiguous() for name, t in tensors.items()}, str(path / ADAPTER_WEIGHTS),
              metadata={"format": "pt"})
    (path / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
