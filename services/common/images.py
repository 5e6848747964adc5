"""An image's encoded bytes checked once, whole and bounded, by decoding them with Pillow: what the buffer does to a
prompt row's images and the agent gateway to the images an agent sends. Never resized or re-encoded here; an image a
plugin made in memory is encoded once, as PNG.
"""

from __future__ import annotations

import base64
import binascii
import io
import warnings
from typing import Any

from services.common.samples import Image

MAX_IMAGE_BYTES = 16 << 20         # one encoded image
MAX_IMAGE_PIXELS = 4096 * 4096     # width x height; checked from the header, before any pixel is decoded
MAX_IMAGES_PER_ROW = 32
MIME_TYPES = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif", "BMP": "image/bmp"}
# The first bytes of each format above: base64 text that decodes to one of these is an image, anything else a path.
MAGIC = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"RIFF", b"GIF87a", b"GIF89a", b"BM")


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
        if data.startswith(MAGIC):
            raise ValueError(f"corrupt image: a {len(data)}-byte image file whose header does not decode") from None
        raise ValueError(f"not an image ({len(data)} bytes starting {data[:8]!r})") from None
    except PILImage.DecompressionBombError as err:  # over Pillow's own limit, refused before our size check
        raise ValueError(f"image too large: {err}") from None
    except (OSError, SyntaxError) as err:  # Pillow's truncated and corrupt files
        raise ValueError(f"corrupt image: {err}") from None
    return Image(data=data, mime_type=mime_type, width=width, height=height)


def decode_base64(text: str) -> bytes:
    if len(text) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise ValueError(f"base64 image of {len(text)} characters (at most {MAX_IMAGE_BYTES} bytes decoded)")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as err:
        raise ValueError(f"invalid base64 image: {err}") from None


def data_url_image(url: str) -> Image:
    """A `data:image/...;base64,` URL's image, checked; ValueError saying what is wrong (a URL to fetch included)."""
    if not url.startswith("data:"):
        raise ValueError(f"image URL {url[:100]!r}: only data: URLs are taken (data:image/png;base64,...); nothing "
                         "is fetched from the network")
    header, comma, payload = url.partition(",")
    if not comma or not header.endswith(";base64"):
        raise ValueError(f"data: URL {url[:40]!r}... is not base64 (expected data:image/...;base64,...)")
    return check_image(decode_base64(payload))


def encoded_image(image: Any) -> Image:
    """An image a plugin made (a Pillow image, as slime's multi-turn environments give) as a checked PNG; an Image
    as it is. PNG, RGB, as slime's encode_image_for_rollout_engine sends it to the engines: the pixels they see."""
    if isinstance(image, Image):
        return image
    if not hasattr(image, "save") or not hasattr(image, "mode"):
        raise ValueError(f"expected a Pillow image or a physarum Image, got {type(image).__name__}")
    width, height = image.size
    if width * height > MAX_IMAGE_PIXELS:
        raise ValueError(f"image of {width}x{height} pixels (at most {MAX_IMAGE_PIXELS / 1e6:.1f} megapixels)")
    buffer = io.BytesIO()
    (image if image.mode == "RGB" else image.convert("RGB")).save(buffer, format="PNG")
    return check_image(buffer.getvalue())
