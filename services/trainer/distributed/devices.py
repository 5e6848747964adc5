"""Where a trainer rank computes and in what precision: its device (cuda:LOCAL_RANK when CUDA is present, else the
CPU), its training dtype (bf16 by default on CUDA, as slime; float32 on CPU), and TF32.

Backends ask here once and keep the answers; the formulas (log-probs, losses) always run in float32 whatever the
model's dtype.
"""

from __future__ import annotations

import contextlib
import os

import torch

DEVICES = ("auto", "cpu", "cuda")


def rank_device(device: str = "auto", local_rank: int | None = None) -> torch.device:
    """This rank's device: `cuda` → cuda:LOCAL_RANK (CUDA must be present), `cpu`, or `auto` (cuda when present)."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("device 'cuda': no CUDA device is visible to this process (use device auto or cpu)")
    index = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
    if index >= torch.cuda.device_count():
        raise ValueError(f"LOCAL_RANK {index}: only {torch.cuda.device_count()} CUDA devices are visible")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def train_dtype(bf16: bool | None, device: torch.device) -> torch.dtype:
    """The dtype a model computes in: bfloat16 under bf16 (None: on CUDA), float32 otherwise (TrainConfig refuses
    fp16)."""
    if bf16 is None:
        bf16 = device.type == "cuda"
    return torch.bfloat16 if bf16 else torch.float32


def configure_matmul(device: torch.device, *, allow_tf32: bool) -> None:
    """TF32 tensor cores for float32 matmuls and convolutions on CUDA (off: bit-faithful float32)."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32
        torch.backends.cudnn.allow_tf32 = allow_tf32


def autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """Mixed-precision compute of a float32-parameter model in `dtype` (a no-op for float32)."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)

