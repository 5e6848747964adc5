"""Write a safetensors file with one copy of the bytes, for weight snapshots in /dev/shm (the engine reads them with
its own one-copy reader; the layout is `services.common.safetensors_format`'s).

The safetensors package builds the whole file as one bytes object before writing it (two copies); here each tensor's
bytes go straight from its memory to the file. The files are standard safetensors, readable by SGLang and
`safetensors.torch.load_file`.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from services.common.safetensors_format import encode_header

CODES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
         torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
         torch.bool: "BOOL"}


def write(path: str | Path, named: Iterable[tuple[str, torch.Tensor]], metadata: dict[str, str] | None = None) -> int:
    """Write `named` (contiguous CPU tensors) as a safetensors file; returns the bytes of tensor data written."""
    tensors = list(named)
    for name, tensor in tensors:
        if tensor.dtype not in CODES:
            raise ValueError(f"tensor {name!r}: dtype {tensor.dtype} has no safetensors code")
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(f"tensor {name!r}: write takes contiguous CPU tensors, got {tensor.device} "
                             f"(contiguous: {tensor.is_contiguous()})")
    entries = [(name, CODES[t.dtype], list(t.shape), t.numel() * t.element_size()) for name, t in tensors]
    with open(path, "wb", buffering=0) as out:
        out.write(encode_header(entries, metadata))
        for _, tensor in tensors:
            if tensor.numel():
                out.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B"))
    return sum(size for *_, size in entries)
