"""The safetensors file layout without torch: an 8-byte little-endian header length, a JSON header (each tensor's
dtype code, shape and byte range; `__metadata__`), padded to 8 bytes, then the tensors' bytes. The trainer writes
weight snapshots in it and the engine reads them, each with its own one-copy torch side."""

from __future__ import annotations

import json
import struct
from pathlib import Path

CODES = ("F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL")  # the dtypes both sides know


def encode_header(tensors: list[tuple[str, str, list[int], int]], metadata: dict[str, str] | None = None) -> bytes:
    """The file's first bytes (length and header) for `tensors` as (name, dtype code, shape, bytes), in the order
    their bytes follow."""
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, code, shape, size in tensors:
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the format pads the header to 8 bytes
    return struct.pack("<Q", len(head)) + head


def read_header(path: str | Path) -> tuple[dict[str, tuple[str, tuple[int, ...], int, int]], int]:
    """Each tensor's (dtype code, shape, start, end) by name, and where the data begins in the file."""
    try:
        with open(path, "rb") as src:
            (length,) = struct.unpack("<Q", src.read(8))
            header = json.loads(src.read(length))
        entries = {}
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            if meta["dtype"] not in CODES:
                raise KeyError(f"dtype {meta['dtype']!r}")
            start, end = meta["data_offsets"]
            entries[name] = (meta["dtype"], tuple(int(d) for d in meta["shape"]), int(start), int(end))
    except (struct.error, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{path}: not a safetensors file this reader knows ({type(err).__name__}: {err})") from err
    return entries, 8 + length
