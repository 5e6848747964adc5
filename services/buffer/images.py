"""A prompt row's images: each value of an image column read (a file under the data roots, a `data:` URL, base64 text
or raw bytes), decoded once with Pillow to check it is whole and bounded, and kept as its encoded bytes.

The buffer never resizes or re-encodes an image; fitting it to a model is the engine's and the trainer's processor's.
"""

from __future__ import annotations

import base64
import binascii
import io
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.common.paths import confine
from services.common.samples import Image

MAX_IMAGE_BYTES = 16 << 20         # one encoded image
MAX_IMAGE_PIXELS = 4096 * 4096     # width x height; checked from the header, before any pixel is decoded
MAX_IMAGES_PER_ROW = 32
MIME_TYPES = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif", "BMP": "image/bmp"}
# The first bytes of each format above: base64 text that decodes to one of these is an image, anything else a path.
_MAGIC = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"RIFF", b"GIF87a", b"GIF89a", b"BM")
# Keys of an image given as an object: a Hugging Face datasets Image column (bytes, path), Qwen-VL's {"type": "image",
# "image": ...}. Qwen-VL's per-image resize hints (min_pixels, max_pixels) are refused rather than ignored.
_OBJECT_KEYS = frozenset({"bytes", "path", "image", "type"})


def read_image(value: Any, *, base_dir: Path, roots: Sequence[str]) -> Image:
    """One image column item as an Image; ValueError saying what is wrong with it."""
    return check_image(_image_bytes(value, base_dir, roots))


def check_image(data: bytes) -> Image:
    """Encoded image bytes, decoded whole to prove them (a truncated or corrupt file fails here, not in an engine)."""
    from PIL import Image as PILImage
    from PIL import UnidentifiedImageError

    if len(data) > MAX_IMAGE_BYTES:
        raise ValueError(f"image of {len(data)} bytes (at most {MAX_IMAGE_BYTES})")
    try:
        with warnings.catch_warnings():  # the pixel bound below is ours, lower than Pillow's warning's
            warnings.simplefilter("ignore", PILImage.DecompressionBombWarning)
            opened = PILImage.open(io.BytesIO(data))
        with opened as image:
            width, height = image.size
            if width * height > MAX_IMAGE_PIXELS:
                raise ValueError(f"image of {width}x{height} pixels ({width * height / 1e6:.1f} megapixels; at most "
                                 f"{MAX_IMAGE_PIXELS / 1e6:.1f})")
            if image.format not in MIME_TYPES:
                raise ValueError(f"image format {image.format} (expected one of {', '.join(MIME_TYPES)})")
            image.load()
            mime_type = MIME_TYPES[image.format]
    except UnidentifiedImageError:
        if data.startswith(_MAGIC):
            raise ValueError(f"corrupt image: a {len(data)}-byte image file whose header does not decode") from None
        raise ValueError(f"not an image ({len(data)} bytes starting {data[:8]!r})") from None
    except PILImage.DecompressionBombError as err:  # over Pillow's own limit, refused before our size check
        raise ValueError(f"image too large: {err}") from None
    except (OSError, SyntaxError) as err:  # Pillow's truncated and corrupt files
        raise ValueError(f"corrupt image: {err}") from None
    return Image(data=data, mime_type=mime_type, width=width, height=height)


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
        return _base64(payload)
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


def _base64(text: str) -> bytes:
    if len(text) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise ValueError(f"base64 image of {len(text)} characters (at most {MAX_IMAGE_BYTES} bytes decoded)")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as err:
        raise ValueError(f"invalid base64 image: {err}") from None


def _maybe_base64(text: str) -> bytes | None:
    """`text` decoded when it is base64 of an image file (its first bytes say so); None when it is not."""
    try:
        data = _base64(text)
    except ValueError:
        return None
    return data if data.startswith(_MAGIC) else None
