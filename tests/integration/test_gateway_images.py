"""Images through the agent gateway, sent by the real `openai` and `anthropic` clients to a real CPU engine serving a
tiny Qwen2.5-VL behind the real sglang-router (through a recording proxy): OpenAI `image_url` parts and Anthropic
`image` blocks reach the engine as SGLang's image_data, every image of the conversation on every turn; the prompt
tokens the gateway sends and records are the engine's own (each image as many image tokens as the model's processor
makes of it); bad images answer 400 naming the message, the part and the problem, as do too many images, a URL to
fetch in either API, and any image on a session of a job that trains on text; each session goes on."""

from __future__ import annotations

import base64
import io
import json

import anthropic
import openai
import pytest
from PIL import Image

from physarum import tasks
from physarum.tinyvlm import build_tiny_vlm
from services.rollout.gateway.trajectory import sample_tokens
from testkit.engines import start_engines, stop_engines
from testkit.images import data_url, png
from tests.integration.engine_proxy import EngineProxy
from tests.integration.gateway_fixtures import GatewayThread

pytestmark = pytest.mark.slow  # a VLM engine of its own

TIMEOUT_S = 120.0


RED, BLUE = png(60, 44, (220, 20, 20)), png(30, 90, (20, 20, 220))


@pytest.fixture(scope="module")
def gateway(shared_router, session_dir):
    model_dir = build_tiny_vlm(session_dir / "tiny-vlm", tasks.corpus())
    engines = start_engines(model_dir, session_dir / "gateway-vlm-engine", 1)
    proxy = EngineProxy(engines[0][1])
    gateway = None
    try:
        shared_router.add_worker(proxy.url, timeout_s=30)
        gateway = GatewayThread(model_dir, shared_router.url)
        yield gateway, proxy, model_dir
    finally:
        try:
            shared_router.remove_worker(proxy.url)
        finally:
            if gateway is not None:
                gateway.close()
            proxy.close()
            stop_engines(engines)


def image_tokens(model_dir, data: bytes) -> int:
    """The image tokens the model's own image processor makes of one image (its merged patches)."""
    from transformers import AutoImageProcessor

    grid = AutoImageProcessor.from_pretrained(model_dir)(images=[Image.open(io.BytesIO(data)).convert("RGB")],
                                                         return_tensors="pt")["image_grid_thw"][0]
    return int(grid.prod()) // 4


def image_runs(ids: list[int], image_token: int) -> list[int]:
    return [len(run) for run in "".join("x" if t == image_token else " " for t in ids).split()]


def test_openai_image_parts_reach_the_engine_turn_after_turn_and_the_sample_holds_its_image_tokens(gateway):
    gw, proxy, model_dir = gateway
    image_token = json.loads((model_dir / "config.json").read_text())["image_token_id"]
    session = gw.open(max_new_tokens=200)  # the second user turn's image tokens count in the response budget
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=session.key, timeout=TIMEOUT_S, max_retries=0)
    start = len(proxy.generated)
    first = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(RED)}},
                                          {"type": "text", "text": "which color?"}]}]
    reply = client.chat.completions.create(model="m", messages=first, max_tokens=4)
    (request, engine_reply), = proxy.since(start)
    assert request["image_data"] == [data_url(RED)]
    assert image_runs(request["input_ids"], image_token) == [image_tokens(model_dir, RED)]
    # the engine took the gateway's tokens as they were: its prompt is exactly as long
    assert engine_reply["meta_info"]["prompt_tokens"] == len(request["input_ids"])
    assert reply.usage.prompt_tokens == len(request["input_ids"])

    second = [*first, {"role": "assistant", "content": reply.choices[0].message.content},
              {"role": "user", "content": [{"type": "text", "text": "and "},
                                           {"type": "image_url", "image_url": {"url": data_url(BLUE)}}]}]
    client.chat.completions.create(model="m", messages=second, max_tokens=4)
    (request2, engine_reply2), = proxy.since(start + 1)
    assert request2["image_data"] == [data_url(RED), data_url(BLUE)]  # every image of the conversation
    first_turn = request["input_ids"] + [e[1] for e in engine_reply["meta_info"]["output_token_logprobs"]]
    assert request2["input_ids"][:len(first_turn)] == first_turn  # the history continued, not re-tokenised
    assert image_runs(request2["input_ids"], image_token) == [image_tokens(model_dir, RED),
                                                               image_tokens(model_dir, BLUE)]
    assert engine_reply2["meta_info"]["prompt_tokens"] == len(request2["input_ids"])
    trained = sample_tokens(session.trajectory.tip)
    generated = [e[1] for e in engine_reply2["meta_info"]["output_token_logprobs"]]
    assert trained.tokens == request2["input_ids"] + generated
    assert [i.data for i in trained.images] == [RED, BLUE]
    assert not session.trajectory.branches
    # the second user turn, its image's tokens included, is masked out of the loss
    context = len(request2["input_ids"]) - len(first_turn)
    assert trained.loss_mask[-len(generated) - context:-len(generated)] == [0] * context
    gw.close_session(session)


def test_anthropic_image_blocks_reach_the_engine(gateway):
    gw, proxy, model_dir = gateway
    image_token = json.loads((model_dir / "config.json").read_text())["image_token_id"]
    session = gw.open(max_new_tokens=16)
    client = anthropic.Anthropic(base_url=gw.url, api_key=session.key, timeout=TIMEOUT_S, max_retries=0)
    start = len(proxy.generated)
    message = client.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": [
        {"type": "text", "text": "which color? "},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": base64.b64encode(BLUE).decode()}}]}])
    (request, engine_reply), = proxy.since(start)
    assert request["image_data"] == [data_url(BLUE)]
    assert image_runs(request["input_ids"], image_token) == [image_tokens(model_dir, BLUE)]
    usage = message.usage  # Anthropic's three input counts add up to the prompt
    assert usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens == len(
        request["input_ids"]) == engine_reply["meta_info"]["prompt_tokens"]
    gw.close_session(session)


def test_bad_images_answer_400_naming_the_part_and_the_problem(gateway):
    gw, proxy, _ = gateway
    session = gw.open()
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=session.key, timeout=TIMEOUT_S, max_retries=0)
    out = io.BytesIO()
    Image.new("1", (12000, 9000)).save(out, format="PNG")  # 108 megapixels in a few hundred kilobytes
    huge = out.getvalue()
    start = len(proxy.generated)
    for url, problem in ((data_url(RED[:len(RED) // 2]), "corrupt image"), (data_url(huge), "108.0 megapixels"),
                         (data_url(b"plain text, not a picture"), "not an image"),
                         ("https://example.com/cat.png", "only data: URLs")):
        with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.content\[1\]: .*" + problem):
            client.chat.completions.create(model="m", max_tokens=4, messages=[{"role": "user", "content": [
                {"type": "text", "text": "which color?"}, {"type": "image_url", "image_url": {"url": url}}]}])
    with pytest.raises(openai.BadRequestError, match="2 image placeholders for 1 images|more image placeholders"):
        client.chat.completions.create(model="m", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "text", "text": "<|vision_start|><|image_pad|><|vision_end|>"},
            {"type": "image_url", "image_url": {"url": data_url(RED)}}]}])
    claude = anthropic.Anthropic(base_url=gw.url, api_key=session.key, timeout=TIMEOUT_S, max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match=r"messages\[0\]\.content\[0\]: corrupt image: .* header"):
        claude.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(b"GIF89a but not really").decode()}}]}])
    with pytest.raises(anthropic.BadRequestError, match="media_type 'image/jpeg', but the data is image/png"):
        claude.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg",
                                         "data": base64.b64encode(RED).decode()}}]}])
    assert proxy.since(start) == []  # none reached the engine
    # the session is still good after them
    assert client.chat.completions.create(model="m", max_tokens=2, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(RED)}}]}]).choices
    gw.close_session(session)


def test_too_many_images_remote_urls_and_images_on_a_text_job_answer_400_and_the_session_goes_on(gateway):
    gw, proxy, _ = gateway
    session = gw.open()
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=session.key, timeout=TIMEOUT_S, max_retries=0)
    claude = anthropic.Anthropic(base_url=gw.url, api_key=session.key, timeout=TIMEOUT_S, max_retries=0)
    start = len(proxy.generated)
    part = {"type": "image_url", "image_url": {"url": data_url(RED)}}
    with pytest.raises(openai.BadRequestError, match="messages: 17 images, at most 16 per request"):
        client.chat.completions.create(model="m", max_tokens=2, messages=[{"role": "user", "content": [part] * 17}])
    with pytest.raises(openai.BadRequestError, match=r"messages\[1\]\.content\[0\]: image URL 'http://10\.0\.0\.1/"
                                                     r"x\.png': only data: URLs are taken"):
        client.chat.completions.create(model="m", max_tokens=2, messages=[
            {"role": "user", "content": [part]},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://10.0.0.1/x.png"}}]}])
    with pytest.raises(anthropic.BadRequestError, match=r"messages\[0\]\.content\[1\]: block type 'image' with "
                                                        r"source type 'url' is not supported \(base64 sources only"):
        claude.messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "text", "text": "which color?"},
            {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}]}])
    # a job without multimodal_keys trains on text: its sessions take no image, from either API
    text_session = gw.open(images=False)
    text_client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=text_session.key, timeout=TIMEOUT_S, max_retries=0)
    text_claude = anthropic.Anthropic(base_url=gw.url, api_key=text_session.key, timeout=TIMEOUT_S, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="1 images, but this session's job trains on text"):
        text_client.chat.completions.create(model="m", max_tokens=2, messages=[{"role": "user", "content": [part]}])
    with pytest.raises(anthropic.BadRequestError, match="1 images, but this session's job trains on text"):
        text_claude.messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(RED).decode()}}]}])
    assert proxy.since(start) == []  # none reached the engine
    # both sessions go on: the image session with its images, the text one with text
    assert client.chat.completions.create(model="m", max_tokens=2, messages=[{"role": "user", "content": [
        part, {"type": "text", "text": "which color?"}]}]).choices
    assert text_client.chat.completions.create(model="m", max_tokens=2, messages=[
        {"role": "user", "content": "which color?"}]).choices
    assert [request.get("image_data") for request, _ in proxy.since(start)] == [[data_url(RED)], None]
    gw.close_session(session)
    gw.close_session(text_session)


def test_responses_input_image_parts_reach_the_engine_and_previous_response_id_keeps_the_images(gateway):
    gw, proxy, model_dir = gateway
    image_token = json.loads((model_dir / "config.json").read_text())["image_token_id"]
    session = gw.open(max_new_tokens=200)
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=session.key, timeout=TIMEOUT_S, max_retries=0)
    start = len(proxy.generated)
    first = client.responses.create(model="m", max_output_tokens=4, input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": data_url(RED), "detail": "auto"},
        {"type": "input_text", "text": "which color?"}]}])
    client.responses.create(model="m", max_output_tokens=4, previous_response_id=first.id, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "and "},
                                     {"type": "input_image", "image_url": data_url(BLUE)}]}])
    (request, reply), (request2, reply2) = proxy.since(start)
    assert request["image_data"] == [data_url(RED)]
    assert request2["image_data"] == [data_url(RED), data_url(BLUE)]  # the previous response's image kept
    first_turn = request["input_ids"] + [e[1] for e in reply["meta_info"]["output_token_logprobs"]]
    assert request2["input_ids"][:len(first_turn)] == first_turn  # continued, not re-tokenised
    assert image_runs(request2["input_ids"], image_token) == [image_tokens(model_dir, RED),
                                                               image_tokens(model_dir, BLUE)]
    trained = sample_tokens(session.trajectory.tip)
    assert [i.data for i in trained.images] == [RED, BLUE] and not session.trajectory.branches
    assert trained.tokens == request2["input_ids"] + [e[1] for e in reply2["meta_info"]["output_token_logprobs"]]
    with pytest.raises(openai.BadRequestError, match=r"input\[0\]\.content\[0\] 'input_image': image URL "
                                                     r"'https://example\.com/cat\.png': only data: URLs"):
        client.responses.create(model="m", max_output_tokens=4, input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "https://example.com/cat.png"}]}])
    gw.close_session(session)


def test_a_screenshot_in_a_tool_result_reaches_the_engine_after_the_gateways_own_turn(gateway):
    """A computer-use agent's loop through the anthropic client: a turn the gateway produced, then the tool's result
    as a screenshot (an image block inside tool_result): the next turn continues the session's tokens, the
    screenshot as image tokens the engine reads from image_data, untrained."""
    gw, proxy, model_dir = gateway
    image_token = json.loads((model_dir / "config.json").read_text())["image_token_id"]
    session = gw.open(max_new_tokens=200)
    claude = anthropic.Anthropic(base_url=gw.url, api_key=session.key, timeout=TIMEOUT_S, max_retries=0)
    start = len(proxy.generated)
    tool = {"name": "screenshot", "description": "the screen", "input_schema": {"type": "object"}}
    messages = [{"role": "user", "content": "what is on the screen?"}]
    first = claude.messages.create(model="m", max_tokens=4, messages=messages, tools=[tool])
    messages += [{"role": "assistant", "content": [block.model_dump() for block in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_0", "content": [
                     {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                  "data": base64.b64encode(BLUE).decode()}}]}]}]
    claude.messages.create(model="m", max_tokens=4, messages=messages, tools=[tool])
    (request, reply), (request2, reply2) = proxy.since(start)
    assert "image_data" not in request and request2["image_data"] == [data_url(BLUE)]
    first_turn = request["input_ids"] + [e[1] for e in reply["meta_info"]["output_token_logprobs"]]
    assert request2["input_ids"][:len(first_turn)] == first_turn and not session.trajectory.branches
    assert image_runs(request2["input_ids"], image_token) == [image_tokens(model_dir, BLUE)]
    trained = sample_tokens(session.trajectory.tip)
    assert [i.data for i in trained.images] == [BLUE]
    context = len(request2["input_ids"]) - len(first_turn)  # the tool's turn, its screenshot's tokens included
    generated = len(reply2["meta_info"]["output_token_logprobs"])
    assert trained.loss_mask[-generated - context:-generated] == [0] * context
    gw.close_session(session)
