"""The tensors of a weight broadcast on the wire: where they must be for the group's backend (the rank's GPU for
NCCL, host memory for gloo), the dtype the engines serve, waiting for a bucket to be sent, and aborting an NCCL
communicator a dead peer left blocked. The protocol around them is `weight_sync.py`'s.
"""

from __future__ import annotations

import json
import logging
import urllib.parse
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# The weight-sync group's own NCCL timeout, in units of weight_sync_timeout_s: past it NCCL's watchdog would end the
# trainer's process, so the sync's own deadline (one timeout_s, then abort) must always come first.
NCCL_TIMEOUT_FACTOR = 4
DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "half": torch.float16}


def wire_device(backend: str) -> torch.device:
    """Where a bucket must be for the group's backend: this rank's GPU under NCCL, the CPU under gloo."""
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise ValueError("weight_sync_backend nccl: no CUDA device is visible to the trainer (use gloo)")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def on_the_wire(tensors: Sequence[torch.Tensor], *, backend: str, dtype: torch.dtype | None) -> list[torch.Tensor]:
    """Contiguous copies (or the tensors themselves) on the backend's device, floating ones in `dtype`."""
    device = wire_device(backend)
    out = []
    for tensor in tensors:
        tensor = tensor.detach()
        target = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        out.append(tensor.to(device=device, dtype=target, non_blocking=True).contiguous())
    return out


def wait_all(works: Sequence[dist.Work], tensors: Sequence[torch.Tensor]) -> None:
    """Block the host until every broadcast of the bucket has completed (NCCL's wait only orders the stream)."""
    for work in works:
        work.wait()
    if tensors and tensors[0].is_cuda:
        torch.cuda.current_stream(tensors[0].device).synchronize()


def abort(group: dist.ProcessGroup) -> None:
    """Abort the group's communicators: a collective blocked on a dead peer returns with an error."""
    try:
        group.abort()
    except Exception as err:  # noqa: BLE001 - already broken or destroyed: the rebuild goes on
        log.warning("aborting the weight-sync group: %s", err)


def served_dtype(server_info: dict, model_dir: str | Path | None) -> torch.dtype | None:
    """The dtype an engine serves, from its /get_server_info `dtype` (SGLang's server argument; the CPU engine's
    setting): "auto" is the checkpoint's own (config.json's dtype / torch_dtype). None when unknown."""
    name = str(server_info.get("dtype") or "auto")
    if name == "auto" and model_dir is not None and (Path(model_dir) / "config.json").is_file():
        config = json.loads((Path(model_dir) / "config.json").read_text())
        name = str(config.get("dtype") or config.get("torch_dtype") or "auto")
    return DTYPES.get(name)


def common_dtype(infos: Sequence[dict], model_dir: str | Path | None) -> torch.dtype | None:
    """The one dtype every engine serves (weights are sent in it), or None (unknown or mixed: sent as they are)."""
    served = {served_dtype(info, model_dir) for info in infos}
    return served.pop() if len(served) == 1 else None


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def auto_backend(infos: Sequence[dict], urls: Sequence[str]) -> str:
    """weight_sync_backend auto: NCCL when this trainer is on CUDA and every engine is a GPU engine (its server_info
    `device` is cuda) on another host; gloo otherwise (CPU engines, or an engine that may share this trainer's GPU,
    where NCCL refuses two ranks on one device)."""
    if not torch.cuda.is_available() or not infos:
        return "gloo"
    gpu_engines = all(str(info.get("device", "")).startswith("cuda") for info in infos)
    remote = all(urllib.parse.urlsplit(url).hostname not in LOOPBACK for url in urls)
    return "nccl" if gpu_engines and remote else "gloo"
