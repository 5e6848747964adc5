"""Weight deltas, the format the trainer writes and the engine applies: per tensor, the elements whose served-precision
bits changed since a base version, as an XOR of the raw bits or as the changed positions with their new values,
compressed with zstd where that is smaller, with a checksum of the tensor's new bits.

Tensors are handled as their raw bits (numpy unsigned integers of the element's width: a bf16 tensor is its uint16
view), so the trainer and the engine share this codec without it importing torch. A blob is MAGIC, an 8-byte
little-endian header length, a JSON header {"base_version", "version", "checksum", "tensors": [...]}, then each
changed tensor's payload at its offset. Tensors that did not change are not in it.

On shared storage (the pull transport) a root holds `full/<version>/model.safetensors`, full snapshots, and
`delta/<version>.delta`, blobs whose header names the version they start from.
"""

from __future__ import annotations

import json
import re
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import xxhash
import zstandard

MAGIC = b"PXWD1\n"
ENCODINGS = ("xor", "overwrite")  # slime's names: xor is involutive (apply once), overwrite is idempotent
CHECKSUMS = ("xxh3-128", "adler32")
ZSTD_LEVEL = 1  # slime's: the deltas are mostly zeros, a higher level buys little and costs time
VERSION_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # versions name files and directories
_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


class ChecksumError(ValueError):
    """A tensor's bits after applying its delta are not the ones the trainer checksummed."""


def check_choice(what: str, value: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{what} must be one of {', '.join(choices)}, got {value!r}")
    return value


def check_version(version: str) -> str:
    """A weight version usable as a file name (delta and snapshot directories are named for it)."""
    if not VERSION_NAME.fullmatch(str(version)):
        raise ValueError(f"weight version {version!r} cannot name a delta: use letters, digits, '.', '_' or '-'")
    return str(version)


def bits_dtype(itemsize: int) -> type:
    if itemsize not in _BITS:
        raise ValueError(f"no delta encoding for {itemsize}-byte elements")
    return _BITS[itemsize]


def checksum(bits: np.ndarray, algo: str) -> str:
    """The checksum of an array's raw bytes."""
    view = memoryview(np.ascontiguousarray(bits)).cast("B")
    if algo == "xxh3-128":
        return xxhash.xxh3_128_hexdigest(view)
    if algo == "adler32":
        return f"{zlib.adler32(view):08x}"
    raise ValueError(f"checksum must be one of {', '.join(CHECKSUMS)}, got {algo!r}")


@dataclass(frozen=True)
class Entry:
    """One changed tensor in a blob: what it is, how its payload is encoded, and its new bits' checksum."""

    name: str
    dtype: str  # torch's name ("bfloat16"): the engine checks it against the parameter's
    shape: list[int]
    encoding: str
    compressed: bool
    num_changed: int
    checksum: str
    offset: int = 0  # of the payload, from the end of the header
    length: int = 0


def encode(old: np.ndarray, new: np.ndarray, encoding: str,
           scratch: np.ndarray | None = None) -> tuple[bytes, int, bool] | None:
    """(payload, number of changed elements, compressed) of `new` against `old` (flat, same unsigned dtype), or None
    when no element changed. `scratch` (at least as large, same dtype) holds the xor: no fresh memory per tensor."""
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding must be one of {', '.join(ENCODINGS)}, got {encoding!r}")
    diff = np.bitwise_xor(old, new, out=None if scratch is None else scratch[:old.size])
    num_changed = int(np.count_nonzero(diff))
    if num_changed == 0:  # an unchanged tensor: nothing to find, gather or compress
        return None
    if encoding == "xor":
        raw: bytes | memoryview = memoryview(diff).cast("B")
    else:  # overwrite
        where = np.flatnonzero(diff != 0)  # over bools: a few times faster than over the wider integers
        gaps = np.diff(where, prepend=-1).astype(np.uint32)  # small numbers, which compress well
        raw = gaps.tobytes() + new[where].tobytes()
    packed = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(raw)
    return (packed, num_changed, True) if len(packed) < len(raw) else (bytes(raw), num_changed, False)


def _decompress(payload: memoryview, size: int, scratch: np.ndarray | None) -> memoryview:
    """A compressed payload's `size` bytes, into `scratch` where given (at least `size` bytes, reused)."""
    if scratch is None:
        return memoryview(zstandard.ZstdDecompressor().decompress(payload))
    out, done = memoryview(scratch).cast("B")[:size], 0
    reader = zstandard.ZstdDecompressor().stream_reader(payload)
    while done < size and (got := reader.readinto(out[done:])):
        done += got
    if done != size or reader.read(1):
        raise ChecksumError(f"payload decompresses to other than the {size} bytes expected")
    return out


def apply(bits: np.ndarray, entry: Entry, payload: memoryview, algo: str, scratch: np.ndarray | None = None) -> None:
    """Apply one tensor's delta to `bits` (flat, in place); raises ChecksumError, leaving `bits` as they were, when
    the result is not the trainer's (a corrupted payload, or `bits` not at the delta's base). `scratch`: reusable
    bytes for a decompressed xor payload (at least the tensor's size)."""
    size = bits.nbytes if entry.encoding == "xor" else entry.num_changed * (4 + bits.itemsize)
    try:
        raw = _decompress(payload, size, scratch if scratch is not None and scratch.nbytes >= size else None) \
            if entry.compressed else payload
    except (zstandard.ZstdError, ChecksumError) as err:
        raise ChecksumError(f"{entry.name}: payload does not decompress: {err}") from err
    if entry.encoding == "xor":
        diff = np.frombuffer(raw, dtype=bits.dtype)
        if diff.size != bits.size:
            raise ChecksumError(f"{entry.name}: {diff.size} elements in the delta, {bits.size} in the tensor")
        np.bitwise_xor(bits, diff, out=bits)
        undo = lambda: np.bitwise_xor(bits, diff, out=bits)  # noqa: E731 - xor undoes itself
    elif entry.encoding == "overwrite":
        count = entry.num_changed
        if len(raw) != count * (4 + bits.itemsize):
            raise ChecksumError(f"{entry.name}: a payload of {len(raw)} bytes cannot hold {count} changes")
        where = np.cumsum(np.frombuffer(raw, dtype=np.uint32, count=count), dtype=np.int64) - 1
        if count and (where[-1] >= bits.size or where[0] < 0):
            raise ChecksumError(f"{entry.name}: changed positions beyond the tensor's {bits.size} elements")
        before = bits[where]
        bits[where] = np.frombuffer(raw, dtype=bits.dtype, offset=4 * count)
        undo = lambda: bits.__setitem__(where, before)  # noqa: E731
    else:
        raise ChecksumError(f"{entry.name}: unknown encoding {entry.encoding!r}")
    if checksum(bits, algo) != entry.checksum:
        undo()
        raise ChecksumError(f"{entry.name}: checksum mismatch after applying its delta")


def pack(base_version: str, version: str, algo: str,
         items: list[tuple[Entry, bytes | memoryview]]) -> tuple[bytearray, list[Entry]]:
    """One blob of the changed tensors' payloads; returns it and the entries with their offsets."""
    entries, offset = [], 0
    for entry, payload in items:
        entries.append(Entry(**{**asdict(entry), "offset": offset, "length": len(payload)}))
        offset += len(payload)
    header = json.dumps({"base_version": base_version, "version": version, "checksum": algo,
                         "tensors": [asdict(e) for e in entries]}).encode()
    blob = bytearray(len(MAGIC) + 8 + len(header) + offset)
    blob[:len(MAGIC)] = MAGIC
    blob[len(MAGIC):len(MAGIC) + 8] = len(header).to_bytes(8, "little")
    start = len(MAGIC) + 8 + len(header)
    blob[len(MAGIC) + 8:start] = header
    for entry, (_, payload) in zip(entries, items, strict=True):
        blob[start + entry.offset:start + entry.offset + entry.length] = payload
    return blob, entries


def unpack(blob: bytes | memoryview) -> tuple[dict, list[Entry], memoryview]:
    """(header, entries, payload area) of a blob; ValueError when it is not one (the whole blob is then unusable)."""
    view = memoryview(blob).cast("B")
    if bytes(view[:len(MAGIC)]) != MAGIC:
        raise ChecksumError("not a weight delta (bad magic)")
    size = int.from_bytes(view[len(MAGIC):len(MAGIC) + 8], "little")
    start = len(MAGIC) + 8 + size
    try:
        header = json.loads(bytes(view[len(MAGIC) + 8:start]))
        entries = [Entry(**e) for e in header["tensors"]]
    except (ValueError, KeyError, TypeError) as err:
        raise ChecksumError(f"weight delta header unreadable: {err}") from err
    payloads = view[start:]
    if any(e.offset + e.length > len(payloads) for e in entries):
        raise ChecksumError("weight delta truncated: a payload runs past its end")
    return header, entries, payloads


FULL_DIR, DELTA_DIR = "full", "delta"


def full_dir(root: str | Path, version: str) -> Path:
    return Path(root) / FULL_DIR / check_version(version)


def delta_file(root: str | Path, version: str) -> Path:
    return Path(root) / DELTA_DIR / f"{check_version(version)}.delta"


def read_header(path: str | Path) -> dict:
    """The header of a blob on disk, read without its payloads."""
    with open(path, "rb") as f:
        head = f.read(len(MAGIC) + 8)
        if head[:len(MAGIC)] != MAGIC:
            raise ChecksumError(f"{path}: not a weight delta (bad magic)")
        try:
            return json.loads(f.read(int.from_bytes(head[len(MAGIC):], "little")))
        except ValueError as err:
            raise ChecksumError(f"{path}: header unreadable: {err}") from err
