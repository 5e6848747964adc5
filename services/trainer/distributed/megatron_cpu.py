"""Run megatron-core 0.16 without a GPU: a shim over the CUDA-only calls it makes, applied only when CUDA is absent.

P1: the model-parallel RNG tracker reads and writes the CPU generator instead of the CUDA one.
P2: `torch.cuda.current_device()` is the CPU device (rotary embeddings, the attention buffer, pipeline p2p).
P3: `cuda_to_cpu()`, a torch-function mode entered only around the calls that hard-code CUDA tensors (Megatron's
schedules, DDP's optimizer set-up and step): CUDA devices become CPU, `.cuda()` is a no-op, CPU float tensors report
CUDA type names. On a GPU machine `apply()` does nothing and `cuda_to_cpu()` is an empty context.
P4 (MoE): the token dispatcher's device-to-host side stream is a host no-op, and the split sizes it moves to the
host as numpy arrays become numpy arrays when they already are on the host.
P5 (MoE, on any device): without Transformer Engine, the router's gating matmul is torch's (megatron-core 0.16
reads an undefined `te_general_gemm` there).
P6 (optimizer offload): megatron-core's HybridDeviceOptimizer moves only parameters that are on a GPU (`is_cuda`) to
pinned host copies; while it sorts them, host parameters pass for device ones and pinning is a no-op (P3), so its
whole copy-out, host step, copy-back path runs as on a GPU.
P7: within `host_backward()`, megatron-core's schedules run each micro-batch's backward outside P3's mode, as the
backend runs a dense model's forward (`outside_cuda_to_cpu`): the backward of a forward that named no CUDA device
names none either, and through the mode each torch call in its Python autograd functions costs a Python call.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

_applied = False
_host_backward = False  # P7: set within host_backward()
CPU = torch.device("cpu")


def needed() -> bool:
    return not torch.cuda.is_available()


def apply() -> None:
    """Patch torch.cuda's RNG and device calls and Megatron's RNG helpers (P1, P2), the MoE dispatcher's stream and
    host copies (P4), and the router without Transformer Engine (P5); idempotent."""
    global _applied
    _router_without_te()
    if _applied or not needed():
        return
    _host_streams()
    _offload_host_parameters()
    _backward_steps_outside_mode()
    from megatron.core.tensor_parallel import random as mcore_random

    def get_rng_state(device="cuda", clone=False, graph_safe=False) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(new_state: torch.Tensor, device=-1, graph_safe=False) -> None:
        torch.set_rng_state(new_state)

    mcore_random._get_cuda_rng_state = get_rng_state
    mcore_random._set_cuda_rng_state = set_rng_state
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    torch.cuda.manual_seed = torch.manual_seed
    torch.cuda.current_device = lambda: CPU
    torch.cuda.synchronize = lambda device=None: None
    # fork() warns on every call that the "CPU RNG state changed within GPU RNG context": here they are one.
    logging.getLogger(mcore_random.__name__).setLevel(logging.ERROR)
    _applied = True


def _backward_steps_outside_mode() -> None:
    from megatron.core.pipeline_parallel import schedules

    backward_step = schedules.backward_step

    @functools.wraps(backward_step)
    def step(*args, **kwargs):
        if not _host_backward:
            return backward_step(*args, **kwargs)
        with outside_cuda_to_cpu():
            return backward_step(*args, **kwargs)

    schedules.backward_step = step


def _router_without_te() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not moe_utils.HAVE_TE and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


class _HostEvent:
    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass


class _HostStream:
    """torch.cuda.Stream's face on a host: work is already ordered, so waiting and events are no-ops."""

    def wait_stream(self, stream) -> None:
        pass

    def record_event(self, event=None) -> _HostEvent:
        return _HostEvent()


_CURRENT_STREAM = _HostStream()


def _host_streams() -> None:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    torch.cuda.Stream = _HostStream
    torch.cuda.current_stream = lambda device=None: _CURRENT_STREAM
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    to_host = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return to_host(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def _offload_host_parameters() -> None:
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    sort = HybridDeviceOptimizer._get_sub_optimizer_param_groups

    def sort_as_on_device(self, offload_fraction: float):
        is_cuda = torch.Tensor.is_cuda
        # only while the parameters are sorted: each passes for a device one, its pinned host copy does not
        torch.Tensor.is_cuda = property(lambda tensor: not getattr(tensor, "_host_copy", False))
        try:
            with _PinnedCopies():
                return sort(self, offload_fraction)
        finally:
            torch.Tensor.is_cuda = is_cuda

    HybridDeviceOptimizer._get_sub_optimizer_param_groups = sort_as_on_device


class _PinnedCopies(TorchFunctionMode):
    """`.pin_memory()` marks its tensor as a host copy (pinning itself needs a GPU), and what is made from a host
    copy (its float32 copy) is one too."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.pin_memory:
            args[0]._host_copy = True
            return args[0]
        result = func(*args, **(kwargs or {}))
        if isinstance(result, torch.Tensor) and any(getattr(a, "_host_copy", False) for a in args):
            result._host_copy = True
        return result


def _to_cpu(device):
    if isinstance(device, str) and device.startswith("cuda"):
        return CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return CPU
    return device


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if "device" in kwargs:
            kwargs["device"] = _to_cpu(kwargs["device"])
        if func is torch.Tensor.to:
            args = tuple(_to_cpu(a) for a in args)
        result = func(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and isinstance(result, str):
            return result.replace("torch.", "torch.cuda.", 1) if ".cuda." not in result else result
        return result


@contextlib.contextmanager
def cuda_to_cpu() -> Iterator[None]:
    """P3 around one call; an empty context when a GPU is present."""
    if not needed():
        yield
        return
    with _CudaToCpu():
        yield


@contextlib.contextmanager
def outside_cuda_to_cpu() -> Iterator[None]:
    """Within `cuda_to_cpu()`, code that names no CUDA device (a dense model's forward, the loss) runs outside its
    mode: every torch call through the mode costs a Python call, 1-3 µs, about 1% of a CPU training step. Elsewhere
    an empty context."""
    from torch.overrides import _get_current_function_mode, _pop_mode_temporarily

    if not isinstance(_get_current_function_mode(), _CudaToCpu):
        yield
        return
    with _pop_mode_temporarily():
        yield


@contextlib.contextmanager
def host_backward(enabled: bool = True) -> Iterator[None]:
    """P7 within it when `enabled` (a model whose forward runs outside the mode); elsewhere, or on a GPU, nothing."""
    global _host_backward
    previous, _host_backward = _host_backward, enabled and needed()
    try:
        yield
    finally:
        _host_backward = previous
