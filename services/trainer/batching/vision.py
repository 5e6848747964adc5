"""The vision inputs of a rollout's samples for a vision-language model's forward: each group's images through the
model's image processor once (the samples of a group share them; a sample whose turns added images has its own), and
per micro-batch the pixel values, patch grids and multimodal rotary positions of its rows, in row order.

The batch finds a row's images by `RolloutBatch.sample_index`; a rollout without images has none and costs nothing.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from services.common.errors import InvalidArgument
from services.common.samples import Sample


@dataclass(frozen=True)
class SampleVision:
    pixel_values: torch.Tensor    # [num_patches, D] on the host
    image_grid_thw: torch.Tensor  # [num_images, 3]


def is_vision_config(hf_config: dict[str, Any]) -> bool:
    return "vision_config" in hf_config and hf_config.get("image_token_id") is not None


def load_image_processor(model_path: Path):
    if not (model_path / "preprocessor_config.json").is_file():
        raise InvalidArgument(f"model {model_path}: a vision-language model without preprocessor_config.json (its "
                              "image processor)")
    from transformers import AutoImageProcessor

    with warnings.catch_warnings():  # without torchvision transformers takes its Pillow processor, and says so
        warnings.simplefilter("ignore")
        return AutoImageProcessor.from_pretrained(model_path)


class RolloutImages:
    """The processed images of one rollout's samples (None for a sample without images), by sample position."""

    def __init__(self, image_processor: Any, samples: list[Sample] | tuple[Sample, ...]) -> None:
        from PIL import Image

        processed: dict[int, SampleVision] = {}
        self.rows: list[SampleVision | None] = []
        for sample in samples:
            if not sample.images:
                self.rows.append(None)
                continue
            key = id(sample.images)  # the samples of a group hold the same list: processed once
            if key not in processed:
                images = [Image.open(io.BytesIO(image.data)).convert("RGB") for image in sample.images]
                out = image_processor(images=images, return_tensors="pt")
                processed[key] = SampleVision(out["pixel_values"], out["image_grid_thw"].to(torch.long))
            self.rows.append(processed[key])

    @property
    def any(self) -> bool:
        return any(row is not None for row in self.rows)

    def forward_inputs(self, model: torch.nn.Module, sample_index: torch.Tensor, input_ids: torch.Tensor,
                       attention_mask: torch.Tensor, prompt_lengths: torch.Tensor, loss_masks: torch.Tensor,
                       placeholders: PromptPlaceholders | None = None) -> dict[str, torch.Tensor]:
        """The vision keyword arguments of the padded forward of rows `sample_index` ({} when none has images):
        pixel values and grids in row order, and the 3-D rotary positions the model's rope index gives them. Only
        the image tokens no policy sampled are images (`image_token_mask`; `placeholders` tells the model so): one
        a policy sampled in a response is a text token, as the engine read it."""
        rows = [self.rows[i] for i in sample_index.tolist()]
        rows = [row for row in rows if row is not None]
        if not rows:
            return {}
        device = input_ids.device
        grid = torch.cat([row.image_grid_thw for row in rows]).to(device)
        images = image_token_mask(input_ids, prompt_lengths, loss_masks, model.config.image_token_id)
        merge = model.config.vision_config.spatial_merge_size
        made, found = int(grid.prod(-1).sum()) // merge**2, int(images.sum())
        if found != made:  # the HF rope index would stop short (a bare StopIteration) or misplace the features
            raise InvalidArgument(f"rollout rows {sample_index.tolist()}: {found} image tokens, but their "
                                  f"{len(grid)} images make {made} (a sample's images are its group's, then its "
                                  "observation_images, in the order of its image tokens)")
        if placeholders is not None:
            placeholders.mask = images
        positions, _ = _inner(model).get_rope_index(input_ids, mm_token_type_ids=images.to(torch.int32),
                                                    image_grid_thw=grid, attention_mask=attention_mask)
        pixel_values = torch.cat([row.pixel_values for row in rows]).to(device)
        return {"pixel_values": pixel_values, "image_grid_thw": grid, "position_ids": positions}


def image_token_mask(input_ids: torch.Tensor, prompt_lengths: torch.Tensor, loss_masks: torch.Tensor,
                     image_token_id: int) -> torch.Tensor:
    """[b, L] bool: the image tokens that stand for images: those of each row's prompt and of its response's
    untrained spans (loss_mask 0: an environment's observations in a multi-turn rollout), not those a policy
    sampled. `loss_masks` [b, R] is response-aligned, as RolloutBatch holds it."""
    device = input_ids.device
    offsets = torch.arange(input_ids.shape[1], device=device)[None] - prompt_lengths.to(device)[:, None]  # [b, L]
    not_sampled = offsets < 0
    if loss_masks.shape[1]:
        in_response = (offsets >= 0) & (offsets < loss_masks.shape[1])
        untrained = loss_masks.to(device).gather(1, offsets.clamp(0, loss_masks.shape[1] - 1)) == 0
        not_sampled = not_sampled | (in_response & untrained)
    return (input_ids == image_token_id) & not_sampled


class PromptPlaceholders:
    """Which image tokens a transformers vision-language model fills with image features: the next forward's
    (`mask`, [b, L] of its input_ids), not every token that has the image token's id. `install` wraps a model's
    placeholder lookup (its inner model's get_placeholder_mask) to read it."""

    def __init__(self) -> None:
        self.mask: torch.Tensor | None = None

    def install(self, model: torch.nn.Module) -> None:
        inner = _inner(model)
        original = inner.get_placeholder_mask
        image_token_id = model.config.image_token_id

        def get_placeholder_mask(input_ids, inputs_embeds, image_features=None, video_features=None):
            if input_ids is not None and self.mask is not None and self.mask.shape == input_ids.shape:
                # a sampled image token reads as text: out of the lookup's reach
                input_ids = input_ids.masked_fill((input_ids == image_token_id) & ~self.mask, -1)
            return original(input_ids, inputs_embeds=inputs_embeds, image_features=image_features,
                            video_features=video_features)

        inner.get_placeholder_mask = get_placeholder_mask


def _inner(model: torch.nn.Module) -> torch.nn.Module:
    """The ...ForConditionalGeneration's inner model, which owns the rope index."""
    return model.model


def image_rows(images: RolloutImages | None, sample_index: torch.Tensor | None) -> list[SampleVision | None]:
    """Each row's processed images (None: a row without), for rows `sample_index` of the rollout."""
    if images is None or sample_index is None:
        return [None] * (0 if sample_index is None else len(sample_index))
    return [images.rows[i] for i in sample_index.tolist()]


def multimodal_positions(tokens: torch.Tensor, lengths: list[int], rows: list[SampleVision | None], *,
                         image_token_id: int, merge_size: int, image_mask: torch.Tensor | None = None) -> torch.Tensor:
    """[3, b, L] int64 (time, height, width) rotary positions of right-padded rows `tokens` [b, L], as Qwen-VL's
    rope index gives them: text tokens count on in all three; an image's tokens (a run of image_token_id) sit on its
    grid of merged patches, each axis from where the text left off; the text after it resumes past the grid's
    largest side. Padding continues the count (causal attention never lets a real token see it). With `image_mask`
    ([b, L] bool, `image_token_mask`), image tokens outside it are text."""
    b, length = tokens.shape
    out = torch.arange(length, dtype=torch.long).repeat(3, b, 1)
    images = (tokens == image_token_id) if image_mask is None else image_mask
    for i, (n, vision) in enumerate(zip(lengths, rows, strict=True)):
        grids = [] if vision is None else vision.image_grid_thw.tolist()
        out[:, i] = _row_positions(images[i, :n].tolist(), grids, length, merge_size)
    return out.to(tokens.device)


def _row_positions(is_image: list[bool], grids: list[list[int]], length: int, merge_size: int) -> torch.Tensor:
    parts, start, position, images = [], 0, 0, iter(grids)
    while start < len(is_image):
        end = start
        while end < len(is_image) and is_image[end] == is_image[start]:
            end += 1
        if not is_image[start]:
            parts.append(torch.arange(position, position + end - start).repeat(3, 1))
            position += end - start
        else:
            grid = next(images, None)
            if grid is None:
                raise InvalidArgument("a sample has more runs of image tokens than images")
            t, h, w = grid[0], grid[1] // merge_size, grid[2] // merge_size
            if t * h * w != end - start:
                raise InvalidArgument(f"an image of {t}×{h}×{w} merged patches has {end - start} image tokens")
            parts.append(torch.stack([torch.arange(t).repeat_interleave(h * w), torch.arange(h).repeat_interleave(w)
                                      .repeat(t), torch.arange(w).repeat(t * h)]) + position)
            position += max(h, w)
        start = end
    row = torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=torch.long)
    tail = torch.arange(position, position + length - row.shape[1]).repeat(3, 1)
    return torch.cat([row, tail], dim=1)
