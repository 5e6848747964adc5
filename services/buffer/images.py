"""A prompt row's images: each value of an image column read (a file under the data roots, a `data:` URL, base64 text
or raw bytes), decoded once with Pillow to check it is whole and bounded (services/common/images.py), and kept as its
encoded bytes.

The buffer never resizes or re-encodes an image; fitting it to a model is the engine's and the trainer's processor's.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.common.images import (  # noqa: F401 - MAX_IMAGE_PIXELS, MAX_IMAGES_PER_ROW: the dataset's bounds
    MAGIC,
    MAX_IMAGE_BYTES,
    MAX_IMAGE_PIXELS,
    MAX_IMAGES_PER_ROW,
    check_image,
    decode_base64,
)
from services.common.paths import confine
from services.common.samples import Image

# Keys of an image given as an object: a Hugging Face datasets Image column (bytes, path), Qwen-VL's {"type": "image",
# "image": ...}. Qwen-VL's per-image resize hints (min_pixels, max_pixels) are refused rather than ignored.
_OBJECT_KEYS = frozenset({"bytes", "path", "image", "type"})


def read_image(value: Any, *, base_dir: Path, roots: Sequence[str]) -> Image:
    """One image column item as an Image; ValueError saying what is wrong with it."""
    return check_image(_image_bytes(value, base_dir, roots))


def _image_bytes(value: Any, base_dir: Path, roots: Sequence[str]) -> bytes:
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, dict):
        unknown = sorted(set(value) - _OBJECT_KEYS)
        if unknown:
            raise ValueError(f"image object with unsupported keys {unknown} (expected bytes, path or image)")
        for key in ("bytes", "image", "path"):
            if value.get(key) is not None:
                return _image_bytes(value[key], base_dir, roots) if key != "path" else _file(value[key], base_dir,
                                                                                           roots)
        raise ValueError("image object holds none of bytes, path or image")
    if not isinstance(value, str):
        raise ValueError(f"an image must be a path, a data: URL, base64 text or bytes, got {type(value).__name__}")
    if value.startswith("data:"):
        header, comma, payload = value.partition(",")
        if not comma or not header.endswith(";base64"):
            raise ValueError(f"data: URL {value[:40]!r}... is not base64 (expected data:image/...;base64,...)")
        return decode_base64(payload)
    if value.startswith(("http://", "https://")):
        raise ValueError(f"image URL {value[:200]!r}: the buffer fetches nothing from the network; put the image in "
                         "the data (a file under the data roots, a data: URL or bytes)")
    if len(value) > 64 and (data := _maybe_base64(value)) is not None:
        return data
    return _file(value, base_dir, roots)


def _file(value: Any, base_dir: Path, roots: Sequence[str]) -> bytes:
    """An image file: a relative path is relative to the dataset's folder; every path must lie under the roots."""
    if not isinstance(value, str):
        raise ValueError(f"an image path must be a string, got {type(value).__name__}")
    path = confine(str(base_dir / value), roots, "image")
    if not path.is_file():
        raise ValueError(f"image {value[:200]!r}: no such file")
    size = path.stat().st_size
    if size > MAX_IMAGE_BYTES:
        raise ValueError(f"image {value[:200]!r} of {size} bytes (at most {MAX_IMAGE_BYTES})")
    return path.read_bytes()


def _maybe_base64(text: str) -> bytes | None:
    """`text` decoded when it is base64 of an image file (its first bytes say so); None when it is not."""
    try:
        data = decode_base64(text)
    except ValueError:
        return None
    return data if data.startswith(MAGIC) else None
