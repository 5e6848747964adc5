"""Small PNG images made on the spot for the image tests, as bytes and as the data: URLs SGLang's image_data takes."""

from __future__ import annotations

import base64
import io

from PIL import Image


def png(width: int, height: int, color: tuple[int, int, int]) -> bytes:
    """A one-colour RGB PNG of width × height."""
    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()
