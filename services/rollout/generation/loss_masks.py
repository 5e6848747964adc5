"""Multi-turn SFT samples (slime's loss_mask_type): a chat's tokens with loss mask 1 on the assistant turns only.

- qwen: each message rendered alone through the chat template; the default system prompt a template adds to a
  lone message is cut off every message but the first; an assistant turn trains from after its header
  ("<|im_start|>assistant\\n") through its end token.
- qwen3: the same, each message rendered next to a fixed user message, so templates that render a message by its
  position (Qwen3's thinking blocks) render it as in the whole chat; consecutive tool messages form one turn.
  (slime also cuts the system prompt length here, which is 0 for Qwen3's templates; cutting the fixed message
  off is what keeps a template with a default system prompt right too.)
- qwen3_5: the whole chat rendered at once (Qwen3.5's template renders a turn by its place in the chat), each token
  trained when its characters fall in an assistant turn: from after its header (and a leading "<think>\n") through
  its "<|im_end|>" and the newline after it.
- distill: the first message as the prompt (with the generation header), the last message's content as the
  response, all of which trains.
A message with `step_loss_mask` other than 1 trains nothing. The response is everything from the first trained
token on (earlier turns inside it keep loss mask 0).
"""

from __future__ import annotations

from typing import Any

from services.common.errors import InvalidArgument
from services.rollout.generation.prompts import PromptEncoder

LOSS_MASK_TYPES = ("qwen", "qwen3", "qwen3_5", "distill")
ASSISTANT_HEADER, THINK_START, TURN_END = "<|im_start|>assistant\n", "<think>\n", "<|im_end|>"  # Qwen3.5's chat
_PROBE = "FOR TESTING ONLY"
_PREFIX = {"role": "user", "content": "FOR CALCULATING LOSS MASK ONLY"}


def _find_all(haystack: list[int], needle: list[int]) -> list[int]:
    n = len(needle)
    return [i for i in range(len(haystack) - n + 1) if haystack[i:i + n] == needle]


class LossMasker:
    """Token ids and loss mask of a chat, for one model's tokenizer and chat template."""

    def __init__(self, encoder: PromptEncoder, loss_mask_type: str) -> None:
        if loss_mask_type not in LOSS_MASK_TYPES:
            raise InvalidArgument(f"loss_mask_type {loss_mask_type!r}: expected one of {', '.join(LOSS_MASK_TYPES)}")
        if encoder.chat_template is None:
            raise InvalidArgument(f"loss_mask_type {loss_mask_type}: {encoder.path} has no chat template")
        self.encoder, self.kind = encoder, loss_mask_type
        self.system_length = self.header_length = 0
        if loss_mask_type in ("qwen", "qwen3"):
            self.system_length, self.header_length = self._template_lengths()

    def _ids(self, messages: list[dict[str, Any]], generation_prompt: bool = False) -> list[int]:
        text = self.encoder.chat_template.render(messages=messages, add_generation_prompt=generation_prompt,
                                                 **self.encoder.special_tokens)
        return self.encoder.encode_text(text)

    def _template_lengths(self) -> tuple[int, int]:
        """(tokens of the system prompt the template adds before a lone message, tokens of the assistant header)."""
        probe = self.encoder.encode_text(_PROBE)
        pair = [{"role": "user", "content": _PROBE}] * 2
        ids = self._ids(pair)
        found = _find_all(ids, probe)
        if len(found) != 2:
            raise InvalidArgument(f"loss_mask_type {self.kind}: the chat template of {self.encoder.path} does not "
                                  f"render message contents as they are")
        first, second = found
        tail = len(ids) - len(probe) - second  # the end of a message after its content
        header = len(self._ids(pair, generation_prompt=True)) - len(ids)
        return first - ((second - first) - tail - len(probe)), header

    def _message_ids(self, group: list[dict[str, Any]], first: bool) -> list[int]:
        """A message's tokens as in the whole chat: qwen renders it alone (the caller cuts the default system
        prompt off); qwen3 renders it after (or, the first, before) a fixed user message and cuts that off."""
        if self.kind == "qwen":
            return self._ids(group)
        alone = self._ids([_PREFIX])
        if first:
            later = len(self._ids([_PREFIX, _PREFIX])) - len(alone)  # the fixed message's tokens after another
            return self._ids(group + [_PREFIX])[:-later]
        return self._ids([_PREFIX] + group)[len(alone):]

    def tokens_and_mask(self, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
        if self.kind == "distill":
            return self._distill(messages)
        if self.kind == "qwen3_5":
            return self._rendered_whole(messages)
        ids: list[int] = []
        mask: list[int] = []
        i = 0
        while i < len(messages):
            end = i + 1
            if self.kind == "qwen3" and messages[i]["role"] == "tool":
                while end < len(messages) and messages[end]["role"] == "tool":
                    end += 1
            message = messages[i]
            message_ids = self._message_ids(messages[i:end], first=i == 0)
            if self.kind == "qwen" and message["role"] != "system" and i > 0:
                message_ids = message_ids[self.system_length:]
            trains = message["role"] == "assistant" and message.get("step_loss_mask", 1) == 1
            body = max(0, len(message_ids) - self.header_length)
            mask += [0] * (len(message_ids) - body) + [1] * body if trains else [0] * len(message_ids)
            ids += message_ids
            i = end
        return ids, mask

    def _rendered_whole(self, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
        """qwen3_5: the chat's tokens, each trained when one of its characters is in a trained assistant turn."""
        text = self.encoder.chat_template.render(messages=messages, add_generation_prompt=False,
                                                 **self.encoder.special_tokens)
        encoding = self.encoder.tokenizer.encode(text, add_special_tokens=False)
        trained = [0] * len(text)
        cursor = 0
        for message in (m for m in messages if m["role"] == "assistant"):
            header = text.find(ASSISTANT_HEADER, cursor)
            end = text.find(TURN_END, header + len(ASSISTANT_HEADER)) if header >= 0 else -1
            if end < 0:
                raise InvalidArgument(f"loss_mask_type qwen3_5: the chat template of {self.encoder.path} renders an "
                                      f"assistant turn without {ASSISTANT_HEADER!r} ... {TURN_END!r}")
            start, end = header + len(ASSISTANT_HEADER), end + len(TURN_END)
            end += text.startswith("\n", end)
            cursor = end
            if message.get("step_loss_mask", 1) == 1:
                start += len(THINK_START) if text.startswith(THINK_START, start) else 0
                trained[start:end] = [1] * (end - start)
        mask = [int(any(trained[a:b])) for a, b in encoding.offsets]
        return encoding.ids, mask

    def _distill(self, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
        prompt = self._ids(messages[:1], generation_prompt=True)
        response = self.encoder.encode_text(messages[-1]["content"])
        trains = messages[-1].get("step_loss_mask", 1) == 1
        return prompt + response, [0] * len(prompt) + [int(trains)] * len(response)


def response_length(mask: list[int]) -> int:
    """Tokens from the first trained one to the end (slime's get_response_lengths)."""
    return len(mask) - mask.index(1) if 1 in mask else 0


_MASKERS: dict[tuple[str, str], LossMasker] = {}


def is_conversation(messages: list[dict[str, Any]]) -> bool:
    """A chat with an assistant turn to learn from (a prompt alone trains on its label instead)."""
    return any(m.get("role") == "assistant" for m in messages)


def conversation_sample(sample: Any, encoder: PromptEncoder, messages: list[dict[str, Any]],
                        loss_mask_type: str) -> Any:
    """Fill an SFT sample from a whole conversation, as slime's sft rollout does: tokens, the response (from the
    first trained token), its loss mask, reward 0."""
    key = (str(encoder.path), loss_mask_type)
    masker = _MASKERS.get(key)
    if masker is None or masker.encoder is not encoder:
        masker = _MASKERS[key] = LossMasker(encoder, loss_mask_type)
    ids, mask = masker.tokens_and_mask(messages)
    n = response_length(mask)
    if n == 0:
        raise InvalidArgument(f"loss_mask_type {loss_mask_type}: prompt {sample.group_index} has no assistant "
                              f"tokens to train on")
    sample.tokens, sample.response_length, sample.loss_mask = ids, n, mask[-n:]
    sample.response = encoder.decode(ids[-n:])
    sample.rollout_log_probs, sample.reward = [0.0] * n, 0.0
    return sample
