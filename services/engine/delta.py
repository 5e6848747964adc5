"""Applying a weight delta (`services.common.weight_delta`'s blob) to the served model, in place.

Each tensor is applied and its checksum checked on its own: a tensor whose check fails is left as it was and named
in the result, for the trainer to send in full; the engine takes the delta's version only when every tensor checked.
Knows nothing of how the blob arrived (a broadcast, or a file pulled from shared storage).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from services.common import weight_delta
from services.common.errors import FailedPrecondition

log = logging.getLogger(__name__)


@dataclass
class DeltaResult:
    base_version: str
    version: str
    applied: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # need a full copy: checksum mismatch, or not this model's

    def reply(self) -> dict:
        return {"weight_version": self.version if not self.failed else self.base_version,
                "num_applied": len(self.applied), "failed_names": self.failed}


def _bits(tensor: torch.Tensor):
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    return tensor.reshape(-1).view(width).numpy().view(weight_delta.bits_dtype(tensor.element_size()))


def apply_blob(params: dict[str, torch.Tensor], blob: bytes | memoryview, current_version: str,
               scratch: np.ndarray | None = None) -> DeltaResult:
    """Apply every tensor of `blob` to `params` (the model's tensors by HF name). Raises FailedPrecondition when
    the blob is unreadable or starts from another version than `current_version` (then nothing changes).
    `scratch`: bytes reused to decompress each tensor's payload into (as large as the largest tensor)."""
    try:
        header, entries, payloads = weight_delta.unpack(blob)
    except weight_delta.ChecksumError as err:
        raise FailedPrecondition(f"weight delta: {err}; a full copy is needed") from err
    base, version, algo = str(header["base_version"]), str(header["version"]), str(header["checksum"])
    if base != current_version:
        raise FailedPrecondition(f"weight delta from version {base!r} to {version!r}, but this engine holds "
                                 f"{current_version!r}; a full copy is needed")
    result = DeltaResult(base, version)
    with torch.no_grad():
        for entry in entries:
            param = params.get(entry.name)
            if param is None or list(param.shape) != entry.shape or str(param.dtype) != f"torch.{entry.dtype}":
                log.warning("weight delta: %s (%s %s) does not match the served model", entry.name, entry.dtype,
                            entry.shape)
                result.failed.append(entry.name)
                continue
            host = param.data if param.device.type == "cpu" and param.data.is_contiguous() else param.data.cpu()
            try:
                weight_delta.apply(_bits(host), entry, payloads[entry.offset:entry.offset + entry.length], algo,
                                   scratch)
            except weight_delta.ChecksumError as err:
                log.warning("weight delta %s -> %s: %s", base, version, err)
                result.failed.append(entry.name)
                continue
            if host is not param.data:
                param.data.copy_(host)
            result.applied.append(entry.name)
    return result
