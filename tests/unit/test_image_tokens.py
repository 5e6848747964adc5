"""The rollout service's image token counts (torch-free) against the model's own image processor, and prompts with
images encoded with their placeholders expanded and sent as SGLang's image_data."""

from __future__ import annotations

import base64
import io
import random

import pytest
from PIL import Image as PILImage

from physarum import tasks
from physarum.tinyvlm import VLM_FAMILIES, build_tiny_vlm
from services.common.errors import InvalidArgument
from services.common.plugin_sample import PluginSample
from services.common.samples import Image, Prompt
from services.rollout.engine_calls.generate import image_data_option
from services.rollout.generation.image_tokens import ImageTokens
from services.rollout.generation.prompts import PromptEncoder


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return build_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm"), tasks.corpus())


def image(width: int, height: int) -> Image:
    out = io.BytesIO()
    PILImage.new("RGB", (width, height), (200, 10, 10)).save(out, format="PNG")
    return Image(data=out.getvalue(), mime_type="image/png", width=width, height=height)


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_counts_equal_the_image_processors_grids(family, tmp_path):
    from transformers import AutoImageProcessor

    model_dir = build_tiny_vlm(tmp_path / family, tasks.corpus(), family=family, num_layers=1)
    processor = AutoImageProcessor.from_pretrained(model_dir)
    tokens = ImageTokens.load(model_dir)
    rng = random.Random(0)
    sizes = [(1, 1), (28, 28), (60, 40), (40, 90), (500, 7), (7, 500), (112, 112), (113, 111), (1000, 999)]
    sizes += [(rng.randint(1, 800), rng.randint(1, 800)) for _ in range(40)]
    for width, height in sizes:
        if max(width, height) / min(width, height) > 200:
            continue
        grid = processor(images=[PILImage.new("RGB", (width, height))], return_tensors="pt")["image_grid_thw"][0]
        assert tokens.count(image(width, height)) == int(grid.prod()) // 4, (width, height)


def test_a_prompt_with_images_is_encoded_with_its_image_tokens_and_sent_with_them(vlm_dir):
    encoder = PromptEncoder(vlm_dir)
    pad = encoder.image_tokens.image_token_id
    images = [image(60, 40), image(56, 56)]
    prompt = Prompt(job_id="j", index=3, epoch=0, images=images, messages=[{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "how many?"}, {"type": "image"}]}])
    text, ids = encoder.encode(prompt)
    assert text.count("<|image_pad|>") == 2
    runs = [len(run) for run in "".join("x" if t == pad else " " for t in ids).split()]
    assert runs == [6, 4]  # 84x56 -> 6x4 patches -> 6 tokens; 56x56 -> 4x4 -> 4
    plain_ids = encoder.encode_text(text)
    assert len(ids) == len(plain_ids) + 5 + 3 and [t for t in ids if t != pad] == [t for t in plain_ids if t != pad]
    sample = PluginSample(tokens=ids, multimodal_inputs={"images": images})
    option = image_data_option([sample])["image_data"]
    assert [base64.b64decode(url.split(",", 1)[1]) for url in option] == [i.data for i in images]
    assert option[0].startswith("data:image/png;base64,")
    assert image_data_option([sample, PluginSample(tokens=[1])])["image_data"][1] == []
    assert image_data_option([PluginSample(tokens=[1])]) == {}  # a text prompt's body is unchanged
    with pytest.raises(InvalidArgument, match="1 image placeholders for 2 images"):
        encoder.encode(Prompt(job_id="j", index=4, epoch=0, images=images,
                              messages=[{"role": "user", "content": [{"type": "image"}]}]))


def test_images_for_a_text_model_are_refused(tiny_model_dir):
    encoder = PromptEncoder(tiny_model_dir)
    assert encoder.image_tokens is None
    with pytest.raises(InvalidArgument, match="has 1 images, but .* is a text model"):
        encoder.encode(Prompt(job_id="j", index=0, epoch=0, images=[image(8, 8)],
                              messages=[{"role": "user", "content": [{"type": "image"}]}]))
