"""The tiny model's weights as the weight-sync tests send them: each tensor once, by HF name, and seeded
perturbations of them (a new version the engines must end up holding bit for bit)."""

from __future__ import annotations

from pathlib import Path

import torch


def hf_weights(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """The model's weights by HF name, each once (a tied lm_head.weight is the embedding)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    seen: set[int] = set()
    weights = {}
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            weights[name] = tensor.detach().clone()
    return weights


def perturbed(weights: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: t + 0.01 * torch.randn(t.shape, generator=gen) for name, t in weights.items()}
