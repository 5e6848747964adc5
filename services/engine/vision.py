"""The CPU engine's images: SGLang's `image_data` decoded (bounded), the model's image processor run over them, and
each image's placeholder in the prompt expanded to the tokens the model reads for it (the Qwen-VL scheme: one image
token per merged patch), so the engine's prompt tokens are the ones the trainer must see.

Generation with the vision inputs is generation.py's; this module knows nothing of scheduling or HTTP.
"""

from __future__ import annotations

import base64
import binascii
import io
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from services.common.errors import InvalidArgument

MAX_IMAGE_BYTES = 16 << 20
MAX_IMAGE_PIXELS = 4096 * 4096
MAX_IMAGES_PER_PROMPT = 32


@dataclass(frozen=True)
class PromptImages:
    """One prompt's images as the model reads them: the processor's patches and each image's patch grid."""

    pixel_values: torch.Tensor    # [num_patches, channels * temporal_patch * patch^2]
    image_grid_thw: torch.Tensor  # [num_images, 3] (temporal, height, width patches)
    tokens_per_image: list[int]


class Vision:
    """A vision-language model's image side: its image processor and its image token."""

    def __init__(self, image_processor: Any, image_token_id: int, merge_size: int,
                 placeholder_ids: tuple[int, ...] = ()) -> None:
        self.image_processor = image_processor
        self.image_token_id = image_token_id
        self.merge_size = merge_size
        # the tokens that only stand for images and videos in a prompt (the image token and its kin): never drawn
        self.placeholder_ids = tuple(sorted({image_token_id, *placeholder_ids}))

    @classmethod
    def load(cls, model_path: str, model: Any) -> Vision | None:
        """The model directory's image processor when the loaded model is a vision-language model (its inner model
        computes the multimodal rotary positions), else None."""
        config = model.config
        vision_config = getattr(config, "vision_config", None)
        if vision_config is None or getattr(config, "image_token_id", None) is None \
                or not hasattr(getattr(model, "model", None), "get_rope_index"):
            return None
        if not (Path(model_path) / "preprocessor_config.json").is_file():
            raise InvalidArgument(f"model {model_path}: a vision-language model without preprocessor_config.json "
                                  "(its image processor)")
        from transformers import AutoImageProcessor

        with warnings.catch_warnings():  # without torchvision, transformers picks its Pillow processor and says so
            warnings.simplefilter("ignore")
            processor = AutoImageProcessor.from_pretrained(model_path)
        kin = (getattr(config, name, None) for name in ("video_token_id", "vision_start_token_id",
                                                         "vision_end_token_id"))
        return cls(processor, config.image_token_id, vision_config.spatial_merge_size,
                   tuple(int(token) for token in kin if token is not None))

    def process(self, image_data: list[Any], where: str) -> PromptImages:
        """The images of one prompt (SGLang's image_data items: data: URLs or base64 text) through the processor."""
        if len(image_data) > MAX_IMAGES_PER_PROMPT:
            raise InvalidArgument(f"{where}: {len(image_data)} images (at most {MAX_IMAGES_PER_PROMPT})")
        images = [decode_image(item, f"{where} image_data[{i}]") for i, item in enumerate(image_data)]
        out = self.image_processor(images=images, return_tensors="pt")
        grid = out["image_grid_thw"].to(torch.long)
        counts = [int(thw.prod()) // self.merge_size**2 for thw in grid]
        return PromptImages(pixel_values=out["pixel_values"], image_grid_thw=grid, tokens_per_image=counts)

    def expand(self, ids: list[int], images: PromptImages, where: str) -> list[int]:
        """`ids` with each run of image tokens (one per image, in order) made as long as its image's tokens: a single
        placeholder (as chat templates render it) is expanded, a run already expanded to that length is kept."""
        out: list[int] = []
        runs = 0
        i = 0
        while i < len(ids):
            if ids[i] != self.image_token_id:
                out.append(ids[i])
                i += 1
                continue
            start = i
            while i < len(ids) and ids[i] == self.image_token_id:
                i += 1
            if runs < len(images.tokens_per_image):
                length, wanted = i - start, images.tokens_per_image[runs]
                if length not in (1, wanted):
                    raise InvalidArgument(f"{where}: image {runs} has {length} image tokens in the prompt; its image "
                                          f"needs {wanted} (or one placeholder to expand)")
                out += [self.image_token_id] * wanted
            runs += 1
        if runs != len(images.tokens_per_image):
            raise InvalidArgument(f"{where}: {runs} image placeholders in the prompt for "
                                  f"{len(images.tokens_per_image)} images in image_data")
        return out

    def mm_token_type_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """1 at image tokens, 0 elsewhere (what the model's rope index reads)."""
        return (input_ids == self.image_token_id).to(torch.int32)


def decode_image(item: Any, where: str):
    """One image_data item as a Pillow image (RGB), checked whole; InvalidArgument naming `where` otherwise."""
    from PIL import Image, UnidentifiedImageError

    if not isinstance(item, str):
        raise InvalidArgument(f"{where}: expected a data: URL or base64 text, got {type(item).__name__}")
    payload = item.partition(",")[2] if item.startswith("data:") else item
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise InvalidArgument(f"{where}: image of more than {MAX_IMAGE_BYTES} bytes")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidArgument(f"{where}: not base64 (the CPU engine takes data: URLs and base64, not paths or "
                              "URLs)") from None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
        if image.width * image.height > MAX_IMAGE_PIXELS:
            raise InvalidArgument(f"{where}: image of {image.width}x{image.height} pixels (at most "
                                  f"{MAX_IMAGE_PIXELS})")
        image.load()
        return image.convert("RGB")
    except UnidentifiedImageError:
        raise InvalidArgument(f"{where}: not an image") from None
    except (OSError, SyntaxError, Image.DecompressionBombError) as err:
        raise InvalidArgument(f"{where}: corrupt image: {err}") from None
