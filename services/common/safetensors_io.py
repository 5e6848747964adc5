"""The safetensors file format written and read with one copy of the bytes, for weight snapshots in /dev/shm.

The safetensors package builds the whole file as one bytes object before writing it (two copies), and its loader
maps the file and leaves every page to fault in on first touch, which on a VM or a sandboxed kernel costs more than
the copy itself. Here the trainer writes each tensor's bytes straight from its memory, and the engine reads each
tensor with readinto into memory it already has. The files are standard safetensors (8-byte little-endian header
length, JSON header, data), readable by SGLang and `safetensors.torch.load_file`.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from pathlib import Path

import torch

CODES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
         torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
         torch.bool: "BOOL"}
DTYPES = {code: dtype for dtype, code in CODES.items()}


def _bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes as a writable buffer over its own memory (contiguous CPU tensors only)."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")


def write(path: str | Path, named: Iterable[tuple[str, torch.Tensor]], metadata: dict[str, str] | None = None) -> int:
    """Write `named` (contiguous CPU tensors) as a safetensors file; returns the bytes of tensor data written."""
    tensors = list(named)
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, tensor in tensors:
        if tensor.dtype not in CODES:
            raise ValueError(f"tensor {name!r}: dtype {tensor.dtype} has no safetensors code")
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(f"tensor {name!r}: write takes contiguous CPU tensors, got {tensor.device} "
                             f"(contiguous: {tensor.is_contiguous()})")
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": CODES[tensor.dtype], "shape": list(tensor.shape), "data_offsets": [offset,
                                                                                                      offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the format pads the header to 8 bytes
    with open(path, "wb", buffering=0) as out:
        out.write(struct.pack("<Q", len(head)) + head)
        for _, tensor in tensors:
            if tensor.numel():
                out.write(_bytes(tensor))
    return offset


def read_header(path: str | Path) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...], int, int]], int]:
    """Each tensor's (dtype, shape, start, end) by name, and where the data begins in the file."""
    try:
        with open(path, "rb") as src:
            (length,) = struct.unpack("<Q", src.read(8))
            header = json.loads(src.read(length))
        entries = {}
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            start, end = meta["data_offsets"]
            entries[name] = (DTYPES[meta["dtype"]], tuple(int(d) for d in meta["shape"]), int(start), int(end))
    except (struct.error, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{path}: not a safetensors file this reader knows ({type(err).__name__}: {err})") from err
    return entries, 8 + length


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
            view = _bytes(target)
            done = 0
            while done < len(view):  # readinto may return fewer bytes than asked
                got = src.readinto(view[done:])
                if not got:
                    raise ValueError(f"{path}: tensor {name!r} ends past the end of the file")
                done += got
