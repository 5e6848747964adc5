"""Device discipline checks for CPU-only machines: the bugs that only a GPU would otherwise show.

`SameDevice` is a TorchFunctionMode that fails any torch call whose tensor arguments sit on more than one device
(0-dim CPU tensors excepted, as torch itself allows them next to CUDA tensors), so code run with its inputs on the
`meta` device fails where a CUDA run would, including ops that accept a mix without complaint (`gather` with a CPU
index on a meta tensor). With `named_factories`, a tensor factory (torch.arange, zeros, tensor, ...) called from
project code without `device=` fails too: on a GPU it would silently land on the CPU. That rule covers code that
needs real values (lengths read back with int()) and so cannot run on `meta`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

PROJECT = Path(__file__).resolve().parents[1]
CHECKED_ROOTS = (PROJECT / "services",)  # the trainer's and the engine's code
TORCH_ROOT = Path(torch.__file__).resolve().parent
FACTORIES = {torch.arange, torch.zeros, torch.ones, torch.full, torch.empty, torch.tensor, torch.as_tensor,
             torch.eye, torch.linspace, torch.rand, torch.randn, torch.randint}
# Calls that move or copy between devices on purpose.
TRANSFERS = {torch.Tensor.to, torch.Tensor.copy_, torch.Tensor.cpu, torch.Tensor.cuda, torch.Tensor.__setitem__}


class DeviceMismatch(AssertionError):
    pass


def _caller() -> Path | None:
    """The file of the first frame outside torch, this module and other torch-function modes: who made the call."""
    frame = sys._getframe(2)
    while frame is not None:
        path = Path(frame.f_code.co_filename).resolve()
        if (path != Path(__file__).resolve() and TORCH_ROOT not in path.parents
                and frame.f_code.co_name != "__torch_function__"):
            return path
        frame = frame.f_back
    return None


def _name(func) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))


class SameDevice(TorchFunctionMode):
    """Raise DeviceMismatch on a torch call mixing devices (and, with named_factories, on a project factory call
    that names no device)."""

    def __init__(self, *, named_factories: bool = False) -> None:
        super().__init__()
        self.named_factories = named_factories
        self.num_checked = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in TRANSFERS:
            tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            found = {t.device for t in tensors if not (t.dim() == 0 and t.device.type == "cpu")}
            self.num_checked += bool(tensors)
            if len(found) > 1:
                raise DeviceMismatch(f"{_name(func)} mixes devices {sorted(map(str, found))} (called from "
                                     f"{_caller()})")
        if self.named_factories and func in FACTORIES and "device" not in kwargs:
            caller = _caller()
            if caller is not None and any(root in caller.parents for root in CHECKED_ROOTS):
                raise DeviceMismatch(f"torch.{_name(func)} without device= in {caller.relative_to(PROJECT)}: on a "
                                     "GPU this tensor would be created on the CPU")
        return func(*args, **kwargs)
