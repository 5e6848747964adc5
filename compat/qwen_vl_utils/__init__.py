"""qwen_vl_utils for slime's plugins: `process_vision_info` and what it builds on, for images, with the Qwen-VL
utilities' contract (each image part of the messages read and resized to multiples of patch size x 2, its pixels
within the token bounds). Without torch: no videos (the engines and trainers here take images only), and nothing is
fetched from the network; every image is decoded bounded (services/common/images.py).
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

from services.common.images import MAX_IMAGE_BYTES, check_image, decode_base64
from services.common.samples import Image

SPATIAL_MERGE_SIZE = 2
MAX_RATIO = 200
IMAGE_MIN_TOKEN_NUM = 4
IMAGE_MAX_TOKEN_NUM = 16384


def smart_resize(height: int, width: int, factor: int, min_pixels: int | None = None,
                 max_pixels: int | None = None) -> tuple[int, int]:
    """(height, width) both multiples of `factor`, their product within [min_pixels, max_pixels] (default 4 and
    16,384 tokens of factor x factor), the aspect ratio kept as closely as that allows."""
    max_pixels = IMAGE_MAX_TOKEN_NUM * factor**2 if max_pixels is None else max_pixels
    min_pixels = IMAGE_MIN_TOKEN_NUM * factor**2 if min_pixels is None else min_pixels
    if max_pixels < min_pixels:
        raise ValueError(f"max_pixels {max_pixels} < min_pixels {min_pixels}")
    if max(height, width) / min(height, width) > MAX_RATIO:
        raise ValueError(f"absolute aspect ratio must be smaller than {MAX_RATIO}, got "
                         f"{max(height, width) / min(height, width)}")
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = math.floor(height / beta / factor) * factor
        w_bar = math.floor(width / beta / factor) * factor
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _open(image: Any) -> Any:
    """A Pillow image from what an image part holds: a Pillow image, a physarum Image, a data: URL, a file:// URL or
    a path."""
    from PIL import Image as PILImage

    if isinstance(image, PILImage.Image):
        return image
    if isinstance(image, Image):
        data = image.data
    elif not isinstance(image, str):
        raise ValueError(f"an image part holds {type(image).__name__}; expected a Pillow image, a data: URL or a path")
    elif image.startswith(("http://", "https://")):
        raise ValueError(f"image {image[:100]!r}: nothing is fetched from the network here; give the image itself "
                         "(a Pillow image, a data: URL or a path)")
    elif image.startswith("data:image"):
        if "base64," not in image:
            raise ValueError(f"data: URL {image[:40]!r}... is not base64")
        data = decode_base64(image.split("base64,", 1)[1])
    else:
        path = Path(image.removeprefix("file://"))
        if path.stat().st_size > MAX_IMAGE_BYTES:
            raise ValueError(f"image file {path}: over {MAX_IMAGE_BYTES} bytes")
        data = path.read_bytes()
    check_image(data)  # whole and bounded before its pixels are decoded
    return PILImage.open(io.BytesIO(data))


def _to_rgb(image: Any) -> Any:
    from PIL import Image as PILImage

    if image.mode == "RGBA":  # transparency over white, as the Qwen-VL utilities do
        background = PILImage.new("RGB", image.size, (255, 255, 255))
        background.paste(image, mask=image.split()[3])
        return background
    return image.convert("RGB")


def fetch_image(ele: dict[str, Any], image_patch_size: int = 14) -> Any:
    """The image of one image part ({"image": ...} or {"image_url": ...}) as RGB, resized as smart_resize says for a
    factor of image_patch_size x 2 (resized_height/resized_width, min_pixels/max_pixels from the part)."""
    image = _to_rgb(_open(ele["image"] if "image" in ele else ele["image_url"]))
    factor = int(image_patch_size * SPATIAL_MERGE_SIZE)
    if "resized_height" in ele and "resized_width" in ele:
        height, width = smart_resize(ele["resized_height"], ele["resized_width"], factor=factor)
    else:
        height, width = smart_resize(image.height, image.width, factor=factor,
                                     min_pixels=ele.get("min_pixels", IMAGE_MIN_TOKEN_NUM * factor**2),
                                     max_pixels=ele.get("max_pixels", IMAGE_MAX_TOKEN_NUM * factor**2))
    return image.resize((width, height))


def extract_vision_info(conversations: list[dict[str, Any]] | list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The image and video parts of one conversation or of several, in order."""
    if conversations and isinstance(conversations[0], dict):
        conversations = [conversations]
    return [part for conversation in conversations for message in conversation
            if isinstance(message["content"], list) for part in message["content"]
            if "image" in part or "image_url" in part or "video" in part
            or part.get("type", "text") in ("image", "image_url", "video")]


def process_vision_info(conversations: list[dict[str, Any]] | list[list[dict[str, Any]]],
                        return_video_kwargs: bool = False, return_video_metadata: bool = False,
                        image_patch_size: int = 14) -> tuple[Any, ...]:
    """(images, videos) of the conversations' parts: the images read and resized (fetch_image), None where there are
    none; videos are always None here (a video part is refused)."""
    images = []
    for part in extract_vision_info(conversations):
        if "image" in part or "image_url" in part:
            images.append(fetch_image(part, image_patch_size=image_patch_size))
        elif "video" in part:
            raise ValueError("a video part: the engines and trainers here take images only")
        else:
            raise ValueError("image, image_url or video should in content.")
    out = (images or None, None)
    return (*out, {"do_sample_frames": False}) if return_video_kwargs else out


__all__ = ["extract_vision_info", "fetch_image", "process_vision_info", "smart_resize"]
