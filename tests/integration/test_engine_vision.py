"""The CPU engine serving a vision-language model (a tiny Qwen2.5-VL, a tiny Qwen3-VL): /generate takes SGLang's
image_data, expands each image placeholder to the model's image tokens, and its log-probs are the HF model's own with
the same images."""

from __future__ import annotations

import io

import httpx
import pytest
import torch
from PIL import Image

from physarum import tasks
from physarum.tinyvlm import VLM_FAMILIES, build_tiny_vlm
from testkit.engines import start_engines, stop_engines
from testkit.images import data_url, png

PROMPT = "<|im_start|>user\nhow many? <|vision_start|><|image_pad|><|vision_end|><|im_end|>\n<|im_start|>assistant\n"


pytestmark = pytest.mark.slow  # a VLM engine process per module


@pytest.fixture(scope="module", params=VLM_FAMILIES)
def vlm_dir(request, session_dir):
    name = "tiny-vlm" if request.param == "qwen2_5_vl" else f"tiny-{request.param}"  # the e2e test's model too
    return build_tiny_vlm(session_dir / name, tasks.corpus(), family=request.param)


@pytest.fixture(scope="module")
def http(vlm_dir, tmp_path_factory):
    engines = start_engines(vlm_dir, tmp_path_factory.mktemp("vlm-engine"), 1)
    try:
        with httpx.Client(base_url=engines[0][1], timeout=120.0) as client:
            yield client
    finally:
        stop_engines(engines)


def hf_logprobs(vlm_dir, prompt_ids: list[int], output_ids: list[int], images: list[bytes]) -> list[float]:
    """The HF model's log-probs of `output_ids` after `prompt_ids`, with its own processor's pixels (temperature 1)."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=torch.float32).eval()
    processor = AutoImageProcessor.from_pretrained(vlm_dir)
    pixels = processor(images=[Image.open(io.BytesIO(i)).convert("RGB") for i in images], return_tensors="pt")
    ids = torch.tensor([prompt_ids + output_ids])
    mm_types = (ids == model.config.image_token_id).to(torch.int32)
    with torch.no_grad():
        logits = model(input_ids=ids, pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"],
                       mm_token_type_ids=mm_types).logits[0]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    start = len(prompt_ids) - 1
    return [float(logprobs[start + k, token]) for k, token in enumerate(output_ids)]


def test_generate_with_images_expands_the_placeholder_and_matches_the_hf_forward(http, vlm_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(vlm_dir)
    from transformers import AutoImageProcessor

    image = png(60, 40, (255, 0, 0))  # resized to 84x56 (patches of 14) or 96x64 (16): 6x4 patches, 6 image tokens
    grid = AutoImageProcessor.from_pretrained(vlm_dir)(images=[Image.open(io.BytesIO(image))],
                                                       return_tensors="pt")["image_grid_thw"]
    assert grid.tolist() == [[1, 4, 6]]
    body = {"text": PROMPT, "image_data": [data_url(image)], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 3}}
    reply = http.post("/generate", json=body)
    assert reply.status_code == 200, reply.text
    out = reply.json()
    short_ids = tokenizer(PROMPT)["input_ids"]
    image_token = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert short_ids.count(image_token) == 1
    assert out["meta_info"]["prompt_tokens"] == len(short_ids) + 5  # the one placeholder became 6 image tokens
    at = short_ids.index(image_token)
    expanded = short_ids[:at] + [image_token] * 6 + short_ids[at + 1:]
    output_ids = [token for _, token, _ in out["meta_info"]["output_token_logprobs"]]
    engine_logprobs = [logprob for logprob, _, _ in out["meta_info"]["output_token_logprobs"]]
    assert output_ids == out["output_ids"] and len(output_ids) == 6
    assert engine_logprobs == pytest.approx(hf_logprobs(vlm_dir, expanded, output_ids, [image]), abs=1e-5)
    # the same prompt given as expanded input_ids (the tokens a sample keeps) generates the same
    again = http.post("/generate", json={**body, "text": None, "input_ids": expanded}).json()
    assert again["output_ids"] == output_ids and again["meta_info"]["prompt_tokens"] == len(expanded)
    # a different image is a different prompt
    other = http.post("/generate", json={**body, "image_data": [data_url(png(40, 90, (0, 0, 255)))]}).json()
    other_lp = [lp for lp, _, _ in other["meta_info"]["output_token_logprobs"]]
    assert other["meta_info"]["prompt_tokens"] != out["meta_info"]["prompt_tokens"] or other_lp != engine_logprobs


def test_sampling_never_draws_an_image_placeholder_and_keeps_the_whole_vocabularys_log_probs(http, vlm_dir):
    """At random initialisation the four vision tokens are about 1 in 20 of a sampled token's mass: 16 rows of 16
    tokens would draw a dozen of them. None is drawn, batched (temperature alone) or per row (top-p), and each drawn
    token's log-prob is still the HF model's over the whole vocabulary."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(vlm_dir)
    placeholders = {tokenizer.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>",
                                                                 "<|vision_end|>")}
    image = png(60, 40, (255, 0, 0))
    drawn = []
    for extra in ({}, {"top_p": 0.999}):
        replies = http.post("/generate", json={
            "text": [PROMPT] * 16, "image_data": [[data_url(image)]] * 16, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True, **extra}}).json()
        drawn += [token for reply in replies for token in reply["output_ids"]]
    assert len(drawn) == 2 * 16 * 16 and not placeholders & set(drawn)
    first = replies[0]
    expanded = http.post("/generate", json={"text": PROMPT, "image_data": [data_url(image)],
                                            "sampling_params": {"max_new_tokens": 0}}).json()
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    at = prompt_ids.index(tokenizer.convert_tokens_to_ids("<|image_pad|>"))
    prompt_ids = prompt_ids[:at] + [prompt_ids[at]] * 6 + prompt_ids[at + 1:]
    assert expanded["meta_info"]["prompt_tokens"] == len(prompt_ids)
    assert [lp for lp, _, _ in first["meta_info"]["output_token_logprobs"]] == pytest.approx(
        hf_logprobs(vlm_dir, prompt_ids, first["output_ids"], [image]), abs=1e-5)


def test_text_rows_and_image_rows_batch_together(http, vlm_dir):
    image = png(56, 56, (0, 255, 0))
    params = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    alone = http.post("/generate", json={"text": PROMPT, "image_data": [data_url(image)], "return_logprob": True,
                                         "sampling_params": params}).json()
    text_alone = http.post("/generate", json={"text": "1+1=", "return_logprob": True,
                                              "sampling_params": params}).json()
    both = http.post("/generate", json={"text": ["1+1=", PROMPT], "image_data": [None, [data_url(image)]],
                                        "return_logprob": True, "sampling_params": params}).json()
    assert both[1]["output_ids"] == alone["output_ids"] and both[0]["output_ids"] == text_alone["output_ids"]
    for together, single in ((both[0], text_alone), (both[1], alone)):
        assert [lp for lp, _, _ in together["meta_info"]["output_token_logprobs"]] == pytest.approx(
            [lp for lp, _, _ in single["meta_info"]["output_token_logprobs"]], abs=1e-4)


@pytest.mark.parametrize("image_data, fragment", [
    (["data:image/png;base64,bm90IGFuIGltYWdl"], "prompt image_data[0]: not an image"),
    (["/etc/passwd"], "not base64"),
    ([data_url(png(8, 8, (1, 2, 3)))[:60]], "prompt image_data[0]"),
    ([data_url(png(56, 56, (9, 9, 9)))] * 2, "1 image placeholders in the prompt for 2 images"),
])
def test_bad_images_get_400_naming_them(http, image_data, fragment):
    reply = http.post("/generate", json={"text": PROMPT, "image_data": image_data,
                                         "sampling_params": {"max_new_tokens": 1}})
    assert reply.status_code == 400 and fragment in reply.json()["error"]["message"], reply.text
    assert http.get("/health").status_code == 200
