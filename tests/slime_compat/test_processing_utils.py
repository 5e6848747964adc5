"""slime.utils.processing_utils and qwen_vl_utils as slime's geo3k_vlm_multi_turn rollout calls them: the processor
of a tiny Qwen2.5-VL gives the input_ids transformers' own processor gives (image tokens expanded), without torch;
images read and resized as the Qwen-VL utilities do; images encoded for the engines; bad images refused by name."""

from __future__ import annotations

import base64
import io
import types

import pytest
from PIL import Image as PILImage
from qwen_vl_utils import process_vision_info, smart_resize
from slime.rollout.sglang_rollout import GenerateState
from slime.utils.processing_utils import build_processor_kwargs, encode_image_for_rollout_engine, load_processor

from physarum import tasks
from physarum.tinyvlm import build_tiny_vlm
from services.common.errors import InvalidArgument
from services.common.images import check_image
from testkit.images import data_url, png


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return build_tiny_vlm(tmp_path_factory.mktemp("tiny-vl"), tasks.corpus())


COLOR = (200, 30, 30)


def test_smart_resize_keeps_multiples_of_the_factor_within_the_token_bounds():
    assert smart_resize(56, 28, factor=28) == (84, 56)  # 1,568 px < 4 x 28^2: scaled up by sqrt(2), ceiled
    assert smart_resize(100, 60, factor=28) == (112, 56)  # rounded to the nearest multiples
    assert smart_resize(3000, 3000, factor=28, max_pixels=1000 * 28 * 28) == (868, 868)  # floored under the bound


def test_process_vision_info_reads_each_image_part_and_resizes_it(tmp_path):
    path = tmp_path / "a.png"
    path.write_bytes(png(28, 56, COLOR))
    url = data_url(png(100, 60, COLOR))
    messages = [{"role": "user", "content": [{"type": "image", "image": str(path)}, {"type": "text", "text": "?"},
                                             {"type": "image", "image": url},
                                             {"type": "image", "image": PILImage.new("RGBA", (56, 56))}]}]
    images, videos = process_vision_info(messages)
    assert [image.size for image in images] == [(56, 84), (112, 56), (56, 56)] and videos is None  # (w, h)
    assert all(image.mode == "RGB" for image in images)
    assert process_vision_info([{"role": "user", "content": [{"type": "text", "text": "no image"}]}]) == (None, None)
    for part, message in (({"image": "https://example.com/a.png"}, "nothing is fetched from the network"),
                          ({"image": data_url(png(4, 4, COLOR)[:30])},
                           "corrupt image"),
                          ({"type": "video", "video": "v.mp4"}, "images only")):
        with pytest.raises(ValueError, match=message):
            process_vision_info([{"role": "user", "content": [part]}])


def test_the_processor_gives_transformers_input_ids_without_pixel_values(vlm_dir):
    """transformers' Qwen2.5-VL processor replaces each image placeholder by grid.prod() / merge_size^2 of them, the
    grid its image processor gives, then tokenizes: the same ids, here without torch."""
    from transformers import AutoImageProcessor, AutoTokenizer

    ours = load_processor(str(vlm_dir))
    text = "<|vision_start|><|image_pad|><|vision_end|>which? <|vision_start|><|image_pad|><|vision_end|>"
    parts = [{"type": "image", "image": PILImage.new("RGB", size)} for size in ((30, 90), (60, 40))]
    images, _ = process_vision_info([{"role": "user", "content": parts}])
    got = ours(text=text, **build_processor_kwargs({"images": images, "videos": None}))
    grids = AutoImageProcessor.from_pretrained(vlm_dir)(images=images, return_tensors="pt")["image_grid_thw"]
    expanded = text
    for grid in grids:
        expanded = expanded.replace("<|image_pad|>", "<|placeholder|>" * (int(grid.prod()) // 4), 1)
    expected = AutoTokenizer.from_pretrained(vlm_dir)(expanded.replace("<|placeholder|>", "<|image_pad|>"))
    assert got["input_ids"] == [expected["input_ids"]] and set(got) == {"input_ids", "attention_mask"}
    assert len(got["input_ids"][0]) > len(AutoTokenizer.from_pretrained(vlm_dir)(text)["input_ids"])
    assert ours.image_processor.patch_size == 14
    with pytest.raises(InvalidArgument, match="placeholders"):
        ours(text=text, images=images[:1])


def test_generate_state_has_the_models_processor_and_none_for_a_text_model(vlm_dir, tiny_model_dir):
    def state(path, job):
        return GenerateState(types.SimpleNamespace(hf_checkpoint=str(path), job_id=job, rollout_temperature=1.0,
                                                   rollout_top_p=1.0, rollout_top_k=-1, rollout_max_response_len=4))

    assert state(vlm_dir, "vl").processor is load_processor(str(vlm_dir)) is not None
    assert state(tiny_model_dir, "text").processor is None


def test_images_go_to_the_engines_as_data_urls():
    prompt_image = check_image(png(8, 8, COLOR))  # a prompt's image: its bytes as read, unchanged
    assert encode_image_for_rollout_engine(prompt_image) == \
        "data:image/png;base64," + base64.b64encode(prompt_image.data).decode()
    url = encode_image_for_rollout_engine(PILImage.new("L", (6, 3), 128))  # a Pillow image: RGB PNG, as slime's
    decoded = PILImage.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
    assert url.startswith("data:image/png;base64,") and decoded.mode == "RGB" and decoded.getpixel((5, 2)) == (128,) * 3
    assert build_processor_kwargs({"images": [1]}) == {
        "images": [1], "text_kwargs": {"return_tensors": None, "return_mm_token_type_ids": False},
        "audio_kwargs": {"return_tensors": "pt"}, "images_kwargs": {"return_tensors": "pt"},
        "videos_kwargs": {"return_tensors": "pt"}}
