"""The latest rollout's samples of each job, kept on rank 0 for the dashboard as display records.

A record holds what a person reads (prompt, response, reward, length, weight versions), the prompt's images as small
thumbnails (data: URLs, made once per group), and the response cut into turns at the loss mask's edges, so the
masked parts of a multi-turn or agent trajectory (tool output, the environment's turns) show apart from the model's.
Recording never raises: the samples are for looking at, and a job must not fail over them.
"""

from __future__ import annotations

import base64
import functools
import io
import logging
import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from services.common.samples import Image, Sample

log = logging.getLogger(__name__)

MAX_SAMPLES = 256  # per rollout shown
MAX_TEXT_CHARS = 4000  # per prompt, response or turn
MAX_JOBS = 16  # jobs whose latest rollout is kept
MAX_IMAGES = 8  # per sample shown
THUMBNAIL_PIXELS = 160  # the longer side of an image's thumbnail, at most
MAX_PNG_BYTES = 12 << 10  # a thumbnail's PNG past this is sent as JPEG
MAX_TRANSCRIPT_TURNS = 32  # an agent session's turns shown
MAX_TRANSCRIPT_ITEMS = 16  # messages per turn, tool calls per message, spawned sessions


@dataclass
class Turn:
    text: str
    masked: bool  # loss_mask 0: not the model's tokens (a tool's or the environment's), left out of the loss
    num_tokens: int


@dataclass
class SampleView:
    index: int
    group_index: int
    prompt: str
    prompt_messages: list[dict[str, str]]
    response: str
    reward: float
    response_length: int
    status: str
    weight_versions: list[str]
    reward_error: str = ""
    turns: list[Turn] = field(default_factory=list)
    images: list[str] = field(default_factory=list)  # the prompt's images, in order, as thumbnails' data: URLs
    # an agent's session (the gateway's sample metadata): its turns, the branches its history started, and its
    # transcript (each turn's new messages, the reply with its tool calls, whether it is trained)
    agent_turns: int | None = None
    agent_branches: list[dict[str, Any]] = field(default_factory=list)
    agent_transcript: dict[str, Any] | None = None  # served on its own (SampleBoard.session), not with the list


@dataclass
class RolloutSamples:
    job_id: str
    rollout_id: int
    num_samples: int  # in the rollout; at most MAX_SAMPLES of them are in `samples`
    samples: list[SampleView]


def _clip(text: str) -> str:
    return text if len(text) <= MAX_TEXT_CHARS else text[:MAX_TEXT_CHARS] + f" … ({len(text)} chars)"


@functools.lru_cache(maxsize=4)
def _tokenizer(model_dir: str):
    """The job model's tokenizer (tokenizer.json), to decode each turn's tokens; None when there is none."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def mask_runs(loss_mask: list[int]) -> list[tuple[int, int, bool]]:
    """(start, end, masked) of each run of equal loss-mask values, in order."""
    runs: list[tuple[int, int, bool]] = []
    start = 0
    for i in range(1, len(loss_mask) + 1):
        if i == len(loss_mask) or bool(loss_mask[i]) != bool(loss_mask[start]):
            runs.append((start, i, not loss_mask[start]))
            start = i
    return runs


def turns_of(sample: Sample, tokenizer) -> list[Turn]:
    """The response cut at the loss mask's edges; one turn (the whole response) when nothing is masked."""
    response = sample.tokens[sample.prompt_length:] if sample.tokens else []
    mask = sample.loss_mask[: len(response)]
    if tokenizer is None or not response or len(mask) != len(response) or all(mask):
        return [Turn(text=_clip(sample.response), masked=False, num_tokens=sample.response_length)]
    return [Turn(text=_clip(tokenizer.decode(response[a:b], skip_special_tokens=False)), masked=masked,
                 num_tokens=b - a) for a, b, masked in mask_runs(mask)]


def thumbnail(image: Image) -> str:
    """The image shrunk to at most THUMBNAIL_PIXELS a side, as a data: URL: PNG (sharp for drawn images), or JPEG
    when the PNG is over MAX_PNG_BYTES (a photo), so a rollout's records stay a few MB at most."""
    from PIL import Image as PILImage

    with PILImage.open(io.BytesIO(image.data)) as opened:
        small = opened.convert("RGB")
    small.thumbnail((THUMBNAIL_PIXELS, THUMBNAIL_PIXELS))
    out = io.BytesIO()
    small.save(out, format="PNG")
    kind = "png"
    if out.tell() > MAX_PNG_BYTES:
        out = io.BytesIO()
        small.save(out, format="JPEG", quality=85)
        kind = "jpeg"
    return f"data:image/{kind};base64," + base64.b64encode(out.getvalue()).decode()


def _message_text(message: dict[str, Any], first_image: int) -> tuple[dict[str, str], int]:
    """A prompt message for display: a content of parts as its text with each image part marked [image k]; returns
    it and the index of the next image."""
    content = message.get("content")
    if isinstance(content, list):
        pieces = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "image":
                pieces.append(f"[image {first_image + 1}]")
                first_image += 1
            elif isinstance(part, dict):
                pieces.append(str(part.get("text", "")))
        message = {**message, "content": "".join(pieces)}
    return {k: _clip(str(v)) for k, v in message.items()}, first_image


def view_of(sample: Sample, tokenizer, thumbnails: dict[int, list[str]] | None = None) -> SampleView:
    """The display record of `sample`; `thumbnails` caches the images' thumbnails by their list (a group's samples
    share one)."""
    messages, next_image = [], 0
    for message in sample.prompt_messages:
        shown, next_image = _message_text(message, next_image)
        messages.append(shown)
    images = []
    if sample.images:
        cache = {} if thumbnails is None else thumbnails
        key = id(sample.images)
        if key not in cache:
            cache[key] = [thumbnail(image) for image in sample.images[:MAX_IMAGES]]
        images = cache[key]
    return SampleView(index=sample.index, group_index=sample.group_index, prompt=_clip(sample.prompt),
                      prompt_messages=messages, response=_clip(sample.response), reward=float(sample.reward),
                      response_length=sample.response_length, status=sample.status.name,
                      weight_versions=sorted(set(sample.weight_versions), key=lambda v: (len(v), v)),
                      reward_error=sample.reward_error, turns=turns_of(sample, tokenizer), images=images,
                      **agent_of(sample))


def _count(value: Any) -> int | None:
    """A count from metadata: an int, or the integral float a protobuf Struct (the buffer's wire form) makes of one."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < 0:
        return None
    return int(value)


def agent_of(sample: Sample) -> dict[str, Any]:
    """The agent session from the sample's metadata (the gateway's): its turn count, the branches its history started
    and its transcript; else nothing."""
    metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
    turns, branches = _count(metadata.get("agent_turns")), metadata.get("agent_branches")
    if turns is None:
        return {}
    branches = [{"turn": _count(b.get("turn")), "reason": _clip(str(b.get("reason", "")))}
                for b in (branches if isinstance(branches, list) else []) if isinstance(b, dict)]
    return {"agent_turns": turns, "agent_branches": branches,
            "agent_transcript": _transcript(metadata.get("agent_transcript"))}


def _items(value: Any, limit: int) -> list[dict[str, Any]]:
    return [item for item in value[:limit] if isinstance(item, dict)] if isinstance(value, list) else []


def _shown_message(message: dict[str, Any]) -> dict[str, Any]:
    calls = [{"id": _clip(str(c.get("id", ""))), "name": _clip(str(c.get("name", ""))),
              "arguments": _clip(str(c.get("arguments", "")))}
             for c in _items(message.get("tool_calls"), MAX_TRANSCRIPT_ITEMS)]
    return {"role": _clip(str(message.get("role", ""))), "text": _clip(str(message.get("text", ""))),
            "tool_calls": calls, "num_tool_calls": _count(message.get("num_tool_calls")) or len(calls),
            "tool_call_id": _clip(str(message.get("tool_call_id", "")))}


def _transcript(value: Any) -> dict[str, Any] | None:
    """The gateway's transcript of the session (services/rollout/gateway/transcript.py), re-bounded: metadata is
    free-form, and a plugin may have written anything under the key."""
    if not isinstance(value, dict):
        return None
    turns = []
    for turn in _items(value.get("turns"), MAX_TRANSCRIPT_TURNS):
        reply = turn.get("reply")
        parent = _count(turn.get("parent"))  # -1 (no count): the turn starts the session
        turns.append({"index": _count(turn.get("index")), "parent": -1 if parent is None else parent,
                      "messages": [_shown_message(m) for m in _items(turn.get("messages"), MAX_TRANSCRIPT_ITEMS)],
                      "num_messages": _count(turn.get("num_messages")),
                      "reply": _shown_message(reply) if isinstance(reply, dict) else None,
                      "context_tokens": _count(turn.get("context_tokens")),
                      "generated_tokens": _count(turn.get("generated_tokens")), "trained": turn.get("trained") is True,
                      "finish": _clip(str(turn.get("finish", ""))), "branch": _clip(str(turn.get("branch", "")))})
    spawned = value.get("spawned")
    return {"session": _clip(str(value.get("session", ""))),
            "parent_session": _clip(str(value.get("parent_session", ""))),
            "spawned": [_clip(str(s)) for s in spawned[:MAX_TRANSCRIPT_ITEMS]] if isinstance(spawned, list) else [],
            "turns": turns, "num_turns": _count(value.get("num_turns")) or len(turns)}


class SampleBoard:
    """Each job's latest rollout, as display records; thread-safe (the driver writes, the REST threads read)."""

    def __init__(self, max_jobs: int = MAX_JOBS) -> None:
        self._latest: OrderedDict[str, RolloutSamples] = OrderedDict()
        self._lock = threading.Lock()
        self._max_jobs = max_jobs

    def record(self, job_id: str, rollout_id: int, samples: list[Sample], model_dir: str = "") -> None:
        try:
            tokenizer = _tokenizer(model_dir) if model_dir else None
            thumbnails: dict[int, list[str]] = {}
            views = [view_of(s, tokenizer, thumbnails) for s in samples[:MAX_SAMPLES]]
        except Exception:  # noqa: BLE001 - for display only: the job goes on without them
            log.warning("job %s rollout %d: samples not kept for the dashboard", job_id, rollout_id, exc_info=True)
            return
        with self._lock:
            self._latest[job_id] = RolloutSamples(job_id, rollout_id, len(samples), views)
            self._latest.move_to_end(job_id)
            while len(self._latest) > self._max_jobs:
                self._latest.popitem(last=False)

    def latest(self, job_id: str) -> dict[str, Any] | None:
        """The latest rollout's records; an agent sample's transcript is left out (`has_session` says it has one)."""
        with self._lock:
            record = self._latest.get(job_id)
        if record is None:
            return None
        values = asdict(record)
        for view in values["samples"]:
            view["has_session"] = view.pop("agent_transcript") is not None
        return values

    def session(self, job_id: str, rollout_id: int, position: int) -> dict[str, Any] | None:
        """The agent session's transcript of the sample at `position` in the latest rollout's records, if that is
        rollout `rollout_id` and the sample has one."""
        with self._lock:
            record = self._latest.get(job_id)
        if record is None or record.rollout_id != rollout_id or not 0 <= position < len(record.samples):
            return None
        return record.samples[position].agent_transcript

