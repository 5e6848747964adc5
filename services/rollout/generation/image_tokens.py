"""How many tokens each image of a prompt takes in a vision-language model's input, without torch or transformers:
the Qwen-VL image processors' resize arithmetic (`smart_resize`) over the model's preprocessor_config.json.

A prompt's tokens are then its rendered text's with each image placeholder expanded to that many image tokens, the
tokens the engine's processor expands them to (the engine refuses a prompt whose counts differ from its own).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from services.common.errors import InvalidArgument
from services.common.samples import Image

# the image processors whose resize this module reproduces (Qwen2-VL's, which Qwen2.5-VL, Qwen3-VL and Qwen3.5 use)
QWEN_VL_PROCESSORS = ("Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast", "Qwen2VLImageProcessorPil")


@dataclass(frozen=True)
class ImageTokens:
    image_token_id: int
    patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int

    @classmethod
    def load(cls, model_path: Path) -> ImageTokens | None:
        """The model's image tokenization, when config.json is a vision-language model's; None for a text model."""
        config_path = model_path / "config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        if "vision_config" not in config or config.get("image_token_id") is None:
            return None
        processor_path = model_path / "preprocessor_config.json"
        if not processor_path.is_file():
            raise InvalidArgument(f"model {model_path}: a vision-language model without preprocessor_config.json")
        processor = json.loads(processor_path.read_text())
        kind = processor.get("image_processor_type", "")
        if kind not in QWEN_VL_PROCESSORS:
            raise InvalidArgument(f"model {model_path}: image processor {kind!r} is not one whose image tokens the "
                                  f"rollout service counts ({', '.join(QWEN_VL_PROCESSORS)})")
        size = processor.get("size") or {}
        return cls(image_token_id=int(config["image_token_id"]), patch_size=int(processor["patch_size"]),
                   merge_size=int(processor["merge_size"]),
                   min_pixels=int(processor.get("min_pixels") or size.get("shortest_edge") or 56 * 56),
                   max_pixels=int(processor.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280))

    def count(self, image: Image) -> int:
        """The image tokens of one image: its resized size in patches, merged merge_size x merge_size."""
        height, width = resized(image.height, image.width, self.patch_size * self.merge_size, self.min_pixels,
                                self.max_pixels)
        return (height // self.patch_size) * (width // self.patch_size) // self.merge_size**2

    def expand(self, ids: list[int], images: list[Image], where: str) -> list[int]:
        """`ids` with the k-th image placeholder (one image token, as chat templates render it) made count(k) long."""
        out: list[int] = []
        k = 0
        for token in ids:
            if token != self.image_token_id:
                out.append(token)
                continue
            if k == len(images):
                raise InvalidArgument(f"{where}: the rendered prompt has more image placeholders than its "
                                      f"{len(images)} images (does the chat template render image parts?)")
            out += [token] * self.count(images[k])
            k += 1
        if k != len(images):
            raise InvalidArgument(f"{where}: the rendered prompt has {k} image placeholders for {len(images)} images "
                                  "(does the model's chat template render image parts?)")
        return out


def resized(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen-VL's smart_resize: both sides multiples of `factor`, the area within [min_pixels, max_pixels], the aspect
    ratio kept as closely as that allows."""
    if max(height, width) / min(height, width) > 200:
        raise InvalidArgument(f"image of {width}x{height}: aspect ratio over 200")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar
