"""Read a safetensors file with one copy of the bytes: each tensor's bytes go with readinto straight into memory the
engine already has (the weights' receive buffers). The safetensors package's loader maps the file and leaves every
page to fault in on first touch, which on a VM or a sandboxed kernel costs more than the copy itself. The layout is
`services.common.safetensors_format`'s; the trainer writes the weight snapshots this reads.
"""

from __future__ import annotations

from pathlib import Path

import torch

from services.common import safetensors_format

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}


def read_header(path: str | Path) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...], int, int]], int]:
    """Each tensor's (dtype, shape, start, end) by name, and where the data begins in the file."""
    entries, data_start = safetensors_format.read_header(path)
    return {name: (DTYPES[code], shape, start, end) for name, (code, shape, start, end) in entries.items()}, data_start


def read_into(path: str | Path, targets: dict[str, torch.Tensor]) -> None:
    """Read each named tensor's bytes into `targets[name]` (contiguous CPU tensors of the header's dtype and shape)."""
    entries, data_start = read_header(path)
    with open(path, "rb", buffering=0) as src:
        for name, target in targets.items():
            dtype, shape, start, end = entries[name]
            if (target.dtype, tuple(target.shape)) != (dtype, shape) or not target.is_contiguous():
                raise ValueError(f"{path}: tensor {name!r} is {dtype} {list(shape)}, the target is {target.dtype} "
                                 f"{list(target.shape)}")
            if end == start:
                continue
            src.seek(data_start + start)
            view = memoryview(target.reshape(-1).view(torch.uint8).numpy()).cast("B")
            done = 0
            while done < len(view):  # readinto may return fewer bytes than asked
                got = src.readinto(view[done:])
                if not got:
                    raise ValueError(f"{path}: tensor {name!r} ends past the end of the file")
                done += got
