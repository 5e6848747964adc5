"""What the delta weight-sync tests share: the trainer's weights after small optimizer-like steps, and the check that
an engine holds given weights in bf16 bit for bit."""

from __future__ import annotations

from pathlib import Path

import httpx
import torch

from tests.integration.hf_weights import hf_weights


def sign_steps(model_dir: str | Path, num_steps: int, lr: float = 1e-4) -> list[dict[str, torch.Tensor]]:
    """fp32 master weights after 0..num_steps sign steps of size lr (Adam's first steps move each element by ~lr)."""
    gen = torch.Generator().manual_seed(0)
    weights = hf_weights(model_dir)
    out = [weights]
    for _ in range(num_steps):
        weights = {k: v - lr * torch.sign(torch.randn(v.shape, generator=gen)) for k, v in weights.items()}
        out.append(weights)
    return out


def assert_engines_hold(urls: list[str], weights: dict[str, torch.Tensor], version: str) -> None:
    """Every engine's tensors are `weights` in bf16, bit for bit (compared as the float32 bits of the bf16 values:
    exact, and -0.0 differs from 0.0), and it reports `version`."""
    for url in urls:
        for name, tensor in weights.items():
            reply = httpx.post(f"{url}/get_weights_by_name", json={"name": name, "truncate_size": tensor.numel()},
                               timeout=30)
            reply.raise_for_status()
            got = torch.tensor(reply.json(), dtype=torch.float32).view(torch.int32)
            want = tensor.to(torch.bfloat16).float().flatten().view(torch.int32)
            assert torch.equal(got, want), f"{url}: {name} differs"
        assert httpx.get(f"{url}/model_info", timeout=10).json()["weight_version"] == version
