"""Agents as rollouts: the job's agent function runs once per sample against a session of its own on the agent
gateway (its base URL and key, and the prompt's data), and the finished session becomes the sample, through the same
groups, rewards, filters and buffer as any other. Knows nothing of either API's wire shape (services/rollout/gateway).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.common import plugins
from services.common.errors import FailedPrecondition, InvalidArgument
from services.common.samples import Image, Sample, Status, count_image_parts
from services.rollout.engine_calls.generate import current_context, image_data_url, new_session_id
from services.rollout.gateway.sessions import SessionRegistry
from services.rollout.gateway.trajectory import sample_tokens
from services.rollout.gateway.transcript import transcript
from services.rollout.generation.prompts import PromptEncoder

log = logging.getLogger(__name__)

EXPECTED = "async def agent(base_url: str, api_key: str, prompt: dict) -> float | None"


@dataclass
class AgentGateway:
    """The gateway as the manager holds it: its sessions and the URL agents reach it at (ending in /v1)."""

    registry: SessionRegistry
    base_url: str


@functools.cache
def load_agent_function(path: str) -> Callable[..., Any]:
    return plugins.load_function(path, flag="agent_function_path", expected=EXPECTED, is_async=True, num_params=3)


def agent_generate_function(gateway: AgentGateway | None, path: str, timeout_s: float) -> Callable[..., Any]:
    """A generate function (slime's signature) that runs the agent at `path` for its sample."""
    if gateway is None:
        raise InvalidArgument("agent_function_path: this rollout manager serves no agent gateway")
    agent = load_agent_function(path)

    async def generate(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> Sample | list[Sample]:
        session = current_context().open_session(getattr(sample, "session_id", None) or new_session_id(),
                                                 sampling_params)
        prompt = agent_prompt(sample)
        timed_out, returned = False, None
        try:
            returned = await asyncio.wait_for(agent(gateway.base_url, session.key, prompt), timeout_s)
        except TimeoutError:
            timed_out = True
            log.warning("agent %s: sample %s of prompt %s ran past agent_timeout_s %.0f s; its trajectory so far is "
                        "kept, truncated", path, sample.index, sample.group_index, timeout_s)
        except Exception as err:
            if not session.aborted:
                raise FailedPrecondition(f"agent_function_path {path} raised {type(err).__name__}: {err}") from err
        finally:
            gateway.registry.close(session)
        if returned is not None and (isinstance(returned, bool) or not isinstance(returned, (int, float))
                                     or not math.isfinite(returned)):
            raise FailedPrecondition(f"agent_function_path {path} returned {returned!r}; expected {EXPECTED}")
        return spawned_samples(sample, session, returned, timed_out, f"agent_function_path {path}")

    return generate


def agent_prompt(sample: Sample) -> dict[str, Any]:
    """What the agent function is given: the prompt's text, its messages in OpenAI's Chat Completions form (each
    image part an `image_url` part holding the image as a data: URL, so they can be sent as they are), its images
    as data: URLs in order (for Anthropic's base64 blocks), its label and metadata."""
    images = [image_data_url(image) for image in prompt_images(sample)]
    messages = sample.prompt_messages
    if images:
        urls = iter(images)
        messages = [{**m, "content": [{"type": "image_url", "image_url": {"url": next(urls)}} if p["type"] == "image"
                                      else p for p in m["content"]]} if isinstance(m["content"], list) else m
                    for m in messages]
    return {"prompt": sample.prompt, "messages": messages, "images": images, "label": sample.label,
            "metadata": dict(sample.metadata)}


def prompt_images(sample: Sample) -> list[Image]:
    """The images of the sample's prompt (a job with multimodal_keys), in the order its messages' image parts name
    them."""
    images = (getattr(sample, "multimodal_inputs", None) or {}).get("images") or []
    return list(images)[:count_image_parts(sample.prompt_messages)]


def spawned_samples(sample: Sample, session: Any, reward: float | None, truncated: bool,
                    what: str) -> Sample | list[Sample]:
    """The session's sample, and one more per session it spawned that made a request (a sub-agent's, a restart's),
    each with its own reward (posted on it; the agent's return value is the first session's): slime's fan-out, all in
    the prompt's group, so a group's baseline is over every trajectory its prompt produced."""
    spawned = [child for child in session.children if child.trajectory.tip is not None]
    if not spawned:
        return session_sample(sample, session, reward, truncated, what)
    copies = [copy.deepcopy(sample) for _ in spawned]
    samples = [session_sample(sample, session, reward, truncated, what)] if session.trajectory.tip is not None else []
    for child, child_sample in zip(spawned, copies, strict=True):
        child_sample.session_id = child.id
        samples.append(session_sample(child_sample, child, None, truncated, f"{what} (session {child.id})"))
    return samples


def session_opener(gateway: AgentGateway | None, ctx: Any, encoder: PromptEncoder, model: str,
                   images: bool) -> Callable[..., Any] | None:
    """GenerateContext.open_session for a rollout: sessions of `gateway` that generate through `ctx`, taking images
    when the job trains on them (`images`: it has multimodal_keys)."""
    if gateway is None:
        return None

    def open_session(session_id: str, sampling_params: dict[str, Any], key: str = "") -> Any:
        session = gateway.registry.open(ctx, encoder, sampling_params, session_id=session_id, model=model, key=key,
                                        images=images)
        session.gateway_url = gateway.base_url.removesuffix("/v1")
        return session

    return open_session


def session_sample(sample: Sample, session: Any, reward: float | None, truncated: bool, what: str) -> Sample:
    """The session's trajectory (the path to its last turn) as `sample`, in place; `reward` (else the one posted on
    the session, else none: the job's reward settings score it)."""
    tip = session.trajectory.tip
    if session.aborted:
        sample.status = Status.ABORTED
        return sample
    if tip is None:
        raise FailedPrecondition(f"{what}: the agent made no request through its session")
    trained = sample_tokens(tip)
    prompt = prompt_images(sample)
    if [image.data for image in trained.images[:len(prompt)]] != [image.data for image in prompt]:
        # the trainer reads a sample's image tokens as its group's images, then the sample's own
        raise FailedPrecondition(f"{what}: the session's {len(trained.images)} images do not begin with its prompt's "
                                 f"{len(prompt)}, in order; send the prompt's images first, as prompt['messages'] "
                                 "holds them")
    if trained.images:  # those after the prompt's become the sample's observation_images (finish_plugin_sample)
        sample.multimodal_inputs = {"images": list(trained.images)}
    prompt_length = len(trained.tokens) - trained.response_length
    renderer = session.renderer
    sample.prompt = renderer.decode(trained.tokens[:prompt_length], skip_special_tokens=False)
    sample.tokens, sample.response_length = trained.tokens, trained.response_length
    sample.response = renderer.decode(trained.tokens[prompt_length:])
    sample.loss_mask, sample.rollout_log_probs = trained.loss_mask, trained.rollout_log_probs
    sample.weight_versions = trained.weight_versions
    sample.status = Status.TRUNCATED if truncated or trained.finish == "length" else Status.COMPLETED
    sample.metadata = {**sample.metadata, "agent_turns": session.num_turns,
                       "agent_final_content": tip.messages[-1]["content"],
                       "agent_branches": [{"turn": b.turn, "reason": b.reason} for b in session.trajectory.branches],
                       "agent_transcript": transcript(session.trajectory, session.id,
                                                      session.parent.id if session.parent is not None else "",
                                                      [child.id for child in session.children])}
    reward = reward if reward is not None else session.reward
    if reward is not None:
        sample.reward = float(reward)
    return sample
