"""Agents as rollouts without sockets: what an agent function is given for a prompt with images, and how a gateway
session's images become its sample's (the prompt's first, then the sample's own observation_images), on a character
renderer whose image part is one placeholder token that the real ImageTokens expands."""

from __future__ import annotations

import asyncio

import pytest

from services.common.errors import FailedPrecondition, InvalidArgument
from services.common.plugin_sample import PluginSample, finish_plugin_sample
from services.common.samples import Image
from services.rollout.engine_calls.generate import GenerateContext
from services.rollout.gateway.conversation import Conversation, Limits, assistant_message, from_anthropic, from_openai
from services.rollout.gateway.sessions import SessionRegistry, TurnParams
from services.rollout.generation.agents import agent_prompt, session_sample
from services.rollout.generation.image_tokens import ImageTokens
from testkit.images import data_url, png

END, IMAGE = "\x01", "\x02"  # the end-of-turn "token" and the image placeholder of the renderer below
RED, BLUE = png(28, 28, (220, 20, 20)), png(56, 28, (20, 20, 220))


class ImageCharRenderer:
    """<role>:content END newline per message, an image part as IMAGE; tokens are code points; images take as many
    tokens as a Qwen-VL processor of patch 14, merge 2 makes (a 28x28 image: 1, 56x28: 2)."""

    image_tokens = ImageTokens(image_token_id=ord(IMAGE), patch_size=14, merge_size=2, min_pixels=28 * 28,
                               max_pixels=28 * 28 * 64)

    def render_messages(self, messages, tools=None, add_generation_prompt=True):
        def content(c):
            return c if isinstance(c, str) else "".join(IMAGE if p["type"] == "image" else p["text"] for p in c)

        text = "".join(f"{m['role']}:{content(m['content'])}{END}\n" for m in messages)
        return text + ("assistant:" if add_generation_prompt else "")

    def encode_text(self, text):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def image(data: bytes) -> Image:
    from services.common.images import check_image

    return check_image(data)


def image_prompt_sample() -> PluginSample:
    """A sample of a prompt with one image, as the rollout manager makes it (groups.new_sample)."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "which color?"}]}]
    return PluginSample(prompt="user:\x02which color?", prompt_messages=messages, tokens=[1],
                        multimodal_inputs={"images": [image(RED)]})


def open_session(images: bool = True):
    ctx = GenerateContext(http=None, router_url="http://router", name="rollout 0 of job j", rid_prefix="j-0")
    registry = SessionRegistry(workers=1)
    return registry, registry.open(ctx, ImageCharRenderer(), {"max_new_tokens": 64}, session_id="s", images=images)


def produce(session, conversation: Conversation, reply: str) -> dict:
    """The turn the engine would produce for `conversation` (as Session.turn records it), without an engine."""
    prepared = session.trajectory.prepare(conversation)
    generated = [ord(c) for c in reply + END]
    session.trajectory.record(prepared, conversation, assistant_message(reply, []), generated,
                              [-0.25] * len(generated), ["1"], "stop", make_tip=True)
    return {"role": "assistant", "content": reply}


def test_an_agent_gets_its_prompts_images_as_data_urls_in_messages_it_can_send_as_they_are():
    prompt = agent_prompt(image_prompt_sample())
    assert prompt["images"] == [data_url(RED)]
    assert prompt["messages"] == [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(RED)}}, {"type": "text", "text": "which color?"}]}]
    # the gateway takes them as they are: the same image, in the same place
    conversation = from_openai({"messages": prompt["messages"]}, Limits())
    assert [i.data for i in conversation.images] == [RED] and conversation.messages[0]["content"][0]["type"] == "image"
    text = agent_prompt(PluginSample(prompt="hi", prompt_messages=[{"role": "user", "content": "hi"}]))
    assert text["images"] == [] and text["messages"] == [{"role": "user", "content": "hi"}]


def test_a_sessions_images_after_its_prompts_become_the_samples_observation_images():
    registry, session = open_session()
    sample = image_prompt_sample()
    first = from_openai({"messages": agent_prompt(sample)["messages"]}, Limits())
    reply = produce(session, first, "red")
    # a later turn, in Anthropic's form: an observation with an image
    later = from_anthropic({"messages": [
        {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                  "data": data_url(RED).split(",")[1]}},
                                     {"type": "text", "text": "which color?"}]},
        {"role": "assistant", "content": reply["content"]},
        {"role": "user", "content": [{"type": "text", "text": "and now?"},
                                     {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                  "data": data_url(BLUE).split(",")[1]}}]}]}, Limits())
    produce(session, later, "blue")
    registry.close(session)
    assert session.trajectory.branches == []
    done = finish_plugin_sample(session_sample(sample, session, 1.0, False, "agent"), needs_log_probs="", what="t")
    assert [i.data for i in done.observation_images] == [BLUE]  # the prompt's image travels with its group
    text = "".join(map(chr, done.tokens))
    prompt = f"user:{IMAGE}which color?{END}\nassistant:"
    observation = f"\nuser:and now?{IMAGE * 2}{END}\nassistant:"  # the 56x28 image: two image tokens
    assert text == prompt + "red" + END + observation + "blue" + END
    assert done.loss_mask == [1] * 4 + [0] * len(observation) + [1] * 5  # the observation and its image untrained
    assert done.rollout_log_probs == [-0.25] * 4 + [0.0] * len(observation) + [-0.25] * 5
    assert done.reward == 1.0


def test_a_session_that_does_not_send_its_prompts_images_first_ends_with_an_error_saying_so():
    for messages in ([{"role": "user", "content": "which color?"}],  # no image at all
                     [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(BLUE)}}]}]):
        registry, session = open_session()
        produce(session, from_openai({"messages": messages}, Limits()), "red")
        registry.close(session)
        with pytest.raises(FailedPrecondition, match=r"images do not begin with its prompt's 1, in order; send the "
                                                      r"prompt's images first"):
            session_sample(image_prompt_sample(), session, None, False, "agent")


def test_a_session_of_a_text_job_refuses_images_and_goes_on():
    registry, session = open_session(images=False)
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(RED)}}]}]}

    async def main() -> None:
        with pytest.raises(InvalidArgument, match="1 images, but this session's job trains on text"):
            await session.turn(from_openai(body, Limits()), TurnParams())

    asyncio.run(main())
    assert session.num_turns == 0 and not session.closed
    # a spawned session is the same job's: it refuses them too
    assert registry.spawn(session).takes_images is False
    registry.close(session)
