"""slime's `gpqa` reward model: the option letter a response picks against the correct one; failing a letter, the
correct option's text inside the response. Reads metadata's choices, valid_letters, correct_letter,
correct_answer and answer_text.
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterable
from typing import Any

DEFAULT_LETTERS = list(string.ascii_uppercase[:10])
_LETTER_PATTERNS = [re.compile(p, re.IGNORECASE) for p in (
    r"(?:answer|option|choice)\s*(?:is|:)?\s*([A-Z])",
    r"([A-Z])\s*(?:is\s*(?:the)?\s*correct)",
    r"final\s*(?:answer|option)\s*(?:is|:)?\s*([A-Z])")]
_STANDALONE_CAPITAL = re.compile(r"\b([A-Z])\b")


def _after_thinking(text: str) -> str:
    return text.rsplit("</think>", 1)[-1] if text else ""


def _plain(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).strip()


def picked_letter(response: str, valid: Iterable[str]) -> str | None:
    """The letter the response names ("answer is C", "C is correct"), else its last valid standalone capital."""
    if not response:
        return None
    text = _after_thinking(response)
    valid = {v.upper() for v in valid}
    for pattern in _LETTER_PATTERNS:
        match = pattern.search(text)
        if match and match.group(1).upper() in valid:
            return match.group(1).upper()
    return next((c for c in reversed(_STANDALONE_CAPITAL.findall(text)) if c in valid), None)


def _choices(metadata: dict[str, Any]) -> list[Any] | None:
    choices = metadata.get("choices")
    if isinstance(choices, dict):
        return list(choices.values())
    return list(choices) if choices is not None else None


def gpqa_reward(response: str | None, label: Any, metadata: dict[str, Any] | None = None) -> float:
    """1.0 or 0.0. The label is the correct letter, its index, or the correct option's text. slime records a
    matched option's text in metadata["correct_answer"]; so does this."""
    if response is None:
        return 0.0
    metadata = metadata if metadata is not None else {}
    choices = _choices(metadata)
    if metadata.get("valid_letters"):
        letters = [str(v).upper() for v in metadata["valid_letters"]]
    else:
        letters = list(string.ascii_uppercase[:len(choices)]) if choices else DEFAULT_LETTERS
    correct = metadata.get("correct_letter")
    correct = correct.strip().upper() if isinstance(correct, str) else None
    label_text = None
    if isinstance(label, str):
        label_text = label.strip()
        if len(label_text) == 1 and label_text.upper() in letters and not correct:
            correct = label_text.upper()
    elif isinstance(label, (int, float)) and 0 <= int(label) < len(letters):
        correct = letters[int(label)]
    if not correct and choices and label_text:
        for i, choice in enumerate(choices):
            if _plain(str(choice)) == _plain(label_text):
                correct = letters[i]
                metadata.setdefault("correct_answer", choice)
                break
    picked = picked_letter(response, letters)
    if picked and correct:
        return 1.0 if picked == correct else 0.0
    targets = []
    if correct and choices and correct in letters and letters.index(correct) < len(choices):
        targets.append(str(choices[letters.index(correct)]))
    targets += [str(metadata[k]) for k in ("correct_answer", "answer_text") if metadata.get(k)]
    if label_text:
        targets.append(label_text)
    plain_response = _plain(_after_thinking(response))
    if any(t and t in plain_response for t in {_plain(t) for t in targets if t}):
        return 1.0
    if picked and not correct and label_text:
        return 1.0 if picked == label_text.strip().upper() else 0.0
    return 0.0
