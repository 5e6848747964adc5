"""A session's trajectory as the engines produced it: a tree of turns, each the tokens added before it (the prompt,
or the template's text for the messages that are new) and the tokens the engine generated, never re-tokenised.

A request continues the turn whose messages (and tools) it repeats, longest first: only what is new is rendered and
appended. Continuing any other turn than the last one produced (the agent dropped or edited turns, or picked another
of n choices), or repeating none, starts a branch; branches are recorded and reported with the sample. The sample is
the path ending at the last turn produced. A turn's new images (the image parts of its user messages and tool
results) each take as many image tokens in its context as the model reads for that image, as the engine expands
them. Knows nothing of HTTP or the engines.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from services.common.errors import InvalidArgument
from services.common.samples import Image
from services.rollout.gateway.conversation import Conversation, count_image_parts, message_key, text_of

PROBE = "\x00physarum-probe\x00"
COUNT_CHUNK_CHARS = 16384  # a long text is counted in pieces of about this size, stopping past the bound
WHOLE_CHARS_PER_TOKEN = 8  # a text of up to this many characters per allowed token is tokenized whole at once


class Renderer(Protocol):
    """The job's tokenizer and chat template (the rollout manager's PromptEncoder)."""

    def render_messages(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                        add_generation_prompt: bool = True) -> str: ...

    def encode_text(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    image_tokens: Any  # a vision-language model's ImageTokens (expand(ids, images, where)); None for a text model


@dataclass
class Turn:
    index: int
    parent: Turn | None
    context: list[int]  # tokens added before the generation: loss_mask 0 (the root's: the prompt)
    keys: list[tuple]  # the request's messages and the produced assistant message, canonical
    messages: list[dict[str, Any]]  # those messages as the gateway holds them (what later turns are rendered after)
    tools_key: str
    generated: list[int] = field(default_factory=list)  # loss_mask 1
    log_probs: list[float] = field(default_factory=list)
    weight_versions: list[str] = field(default_factory=list)
    finish: str = ""  # stop, length or abort
    images: list[Image] = field(default_factory=list)  # the images whose tokens `context` holds, in order

    def path(self) -> list[Turn]:
        turns, turn = [], self
        while turn is not None:
            turns.append(turn)
            turn = turn.parent
        return turns[::-1]

    def tokens(self) -> list[int]:
        return [t for turn in self.path() for t in (*turn.context, *turn.generated)]

    def path_images(self) -> list[Image]:
        return [image for turn in self.path() for image in turn.images]


@dataclass(frozen=True)
class Branch:
    turn: int  # the turn that started it
    reason: str


@dataclass
class Prepared:
    """What the next generation starts from: its parent turn, the tokens to add, and why it branches (if it does)."""

    parent: Turn | None
    context: list[int]
    input_ids: list[int]
    branch_reason: str = ""
    images: list[Image] = field(default_factory=list)  # the context's new images
    all_images: list[Image] = field(default_factory=list)  # every image of input_ids, in order (the engine's)
    messages: list[dict[str, Any]] = field(default_factory=list)  # the history the generation continues, canonical


@dataclass
class Trajectory:
    renderer: Renderer
    turns: list[Turn] = field(default_factory=list)
    tip: Turn | None = None  # the last turn produced: the sample
    branches: list[Branch] = field(default_factory=list)
    _turn_suffix: str | None = None

    def prepare(self, conversation: Conversation, context_len: int | None = None) -> Prepared:
        """Match the conversation to the turns produced; render and tokenize only what is new after the match.
        InvalidArgument when the prompt leaves no room for one new token in `context_len`, found before an
        over-long text is tokenized whole."""
        limit = None if context_len is None else context_len - 1
        if limit is not None:  # a message past the context alone is refused before the template copies it
            for message in conversation.messages:
                refuse_past(self.renderer, text_of(message), limit)
        canon = conversation.canonical()
        keys, tools_key = [message_key(m) for m in canon], conversation.tools_key()
        parent = None
        for turn in reversed(self.turns):  # newest first among equally long matches
            k = len(turn.keys)
            if turn.tools_key == tools_key and k < len(keys) and keys[:k] == turn.keys and (
                    parent is None or k > len(parent.keys)):
                parent = turn
        if conversation.images and getattr(self.renderer, "image_tokens", None) is None:
            raise InvalidArgument(f"messages: {len(conversation.images)} images, but the model is a text model and "
                                  "takes no images")
        if parent is None:
            reason = "" if not self.turns else "the history repeats no turn the gateway produced"
            full = self.renderer.render_messages(conversation.messages, conversation.tools, add_generation_prompt=True)
            return self._whole(full, conversation.images, limit, reason, canon)
        # what is new is rendered after the history the gateway holds, not the agent's copy of it: an agent's
        # re-serialized arguments, whitespace or moved system prompt change no token already generated
        messages = [*parent.messages, *canon[len(parent.keys):]]
        full = self.renderer.render_messages(messages, conversation.tools, add_generation_prompt=True)
        done = self.renderer.render_messages(parent.messages, conversation.tools, add_generation_prompt=False)
        if not full.startswith(done):  # the template renders earlier turns differently once more follow
            full = self.renderer.render_messages(conversation.messages, conversation.tools, add_generation_prompt=True)
            return self._whole(full, conversation.images, limit,
                               "the chat template renders the history differently as it grows", canon)
        history = parent.tokens()
        room = None if limit is None else max(0, limit - len(history))
        # the canonical order moves only system messages, which hold no images: the images keep their order
        new_images = conversation.images[sum(count_image_parts(m) for m in canon[:len(parent.keys)]):]
        context = self._expanded(encode_within(self.renderer, self._closing(parent) + full[len(done):], room),
                                 new_images, room)
        reason = "" if parent is self.tip else (f"continues turn {parent.index}, not the last turn "
                                                f"{self.tip.index if self.tip else -1}")
        return Prepared(parent, context, history + context, reason, list(new_images),
                        parent.path_images() + list(new_images), messages)

    def _whole(self, text: str, images: list[Image], limit: int | None, reason: str,
               canon: list[dict[str, Any]]) -> Prepared:
        """The whole conversation as a new root turn."""
        ids = self._expanded(encode_within(self.renderer, text, limit), images, limit)
        return Prepared(None, ids, list(ids), reason, list(images), list(images), canon)

    def _expanded(self, ids: list[int], images: list[Image], limit: int | None) -> list[int]:
        """`ids` with each image placeholder as many image tokens as its image takes; InvalidArgument past `limit`."""
        image_tokens = getattr(self.renderer, "image_tokens", None)
        if image_tokens is None:
            return ids
        ids = image_tokens.expand(ids, images, "messages")  # a placeholder typed as text, with no image, is refused
        if limit is not None and len(ids) > limit:
            raise InvalidArgument(f"the prompt does not fit the model's context: {len(ids)} new tokens with its "
                                  f"images' tokens, room for {limit} (one kept for the reply)")
        return ids

    def _closing(self, turn: Turn) -> str:
        """The template's text after an assistant turn's content that the engine did not generate: all of it, or
        what follows the end-of-turn token the engine stopped at (Qwen's <|im_end|> then a newline)."""
        suffix = self.turn_suffix()
        if turn.finish == "stop" and turn.generated:
            last = self.renderer.decode(turn.generated[-1:], skip_special_tokens=False)
            if last and suffix.startswith(last):
                return suffix[len(last):]
        return suffix

    def turn_suffix(self) -> str:
        if self._turn_suffix is None:
            text = self.renderer.render_messages([{"role": "user", "content": "x"},
                                                  {"role": "assistant", "content": PROBE}],
                                                 add_generation_prompt=False)
            self._turn_suffix = text.split(PROBE, 1)[1] if PROBE in text else ""
        return self._turn_suffix

    def record(self, prepared: Prepared, conversation: Conversation, assistant: dict[str, Any],
               generated: list[int], log_probs: list[float], weight_versions: list[str], finish: str,
               make_tip: bool) -> Turn:
        """Add the turn the engine produced from `prepared`; `make_tip` for the choice the sample follows."""
        messages = [*prepared.messages, assistant]
        turn = Turn(index=len(self.turns), parent=prepared.parent, context=list(prepared.context),
                    keys=[message_key(m) for m in messages], messages=messages, tools_key=conversation.tools_key(),
                    generated=list(generated), log_probs=list(log_probs), weight_versions=list(weight_versions),
                    finish=finish, images=list(prepared.images))
        self.turns.append(turn)
        if make_tip:
            if prepared.branch_reason:
                self.branches.append(Branch(turn.index, prepared.branch_reason))
            self.tip = turn
        return turn


def encode_within(renderer: Renderer, text: str, max_tokens: int | None) -> list[int]:
    """`text`'s tokens; InvalidArgument when there are more than `max_tokens`, found before a text too long to be
    sure of is tokenized whole (refuse_past)."""
    if max_tokens is not None:
        refuse_past(renderer, text, max_tokens)
    ids = renderer.encode_text(text)
    if max_tokens is not None and len(ids) > max_tokens:
        raise InvalidArgument(f"the prompt does not fit the model's context: {len(ids)} new tokens, room for "
                              f"{max_tokens} (one kept for the reply)")
    return ids


def refuse_past(renderer: Renderer, text: str, max_tokens: int) -> None:
    """InvalidArgument if `text`, longer than WHOLE_CHARS_PER_TOKEN characters per allowed token, has more than
    `max_tokens` tokens: counted in pieces cut before whitespace (as the pre-tokenizer cuts), a few times the bound
    at a time, stopping once the count is past it. Tokenizing holds the interpreter's lock, so a huge text must
    never be tokenized whole."""
    if len(text) <= WHOLE_CHARS_PER_TOKEN * max(max_tokens, 1):
        return
    piece_chars = min(COUNT_CHUNK_CHARS, max(1024, 2 * max_tokens))
    counted, pieces, start = 0, 0, 0
    while start < len(text):
        end = min(len(text), start + piece_chars)
        if end < len(text) and (cut := text.rfind(" ", start + piece_chars // 2, end)) > start:
            end = cut
        counted += len(renderer.encode_text(text[start:end]))
        pieces += 1
        if counted > max_tokens + pieces:  # a cut may split one token in two: allow one per piece
            raise InvalidArgument(f"the prompt does not fit the model's context: over {max_tokens} tokens, room "
                                  f"for {max_tokens} (one kept for the reply)")
        start = end


@dataclass
class SampleTokens:
    """The tip's path as slime's sample fields."""

    tokens: list[int]
    response_length: int
    loss_mask: list[int]
    rollout_log_probs: list[float]
    weight_versions: list[str]
    finish: str
    images: list[Image] = field(default_factory=list)  # every image whose tokens `tokens` holds, in order


def sample_tokens(tip: Turn) -> SampleTokens:
    path = tip.path()
    tokens = list(path[0].context)
    prompt_length = len(tokens)
    loss_mask: list[int] = []
    log_probs: list[float] = []
    versions: list[str] = []
    for i, turn in enumerate(path):
        if i:
            tokens += turn.context
            loss_mask += [0] * len(turn.context)
            log_probs += [0.0] * len(turn.context)
        tokens += turn.generated
        loss_mask += [1] * len(turn.generated)
        log_probs += turn.log_probs
        for version in turn.weight_versions:
            if not versions or versions[-1] != version:
                versions.append(version)
    return SampleTokens(tokens, len(tokens) - prompt_length, loss_mask, log_probs, versions, tip.finish,
                        tip.path_images())
