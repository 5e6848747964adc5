"""slime's `f1` reward model: token-level F1 between response and label after SQuAD's answer normalisation."""

from __future__ import annotations

import re
import string
from collections import Counter

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation)
_CLOSED_ANSWERS = ("yes", "no", "noanswer")


def normalize_answer(text: str) -> str:
    """Lower case, no punctuation, no articles, single spaces."""
    text = "".join(c for c in text.lower() if c not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def f1_parts(prediction: str | None, truth: str) -> tuple[float, float, float]:
    """(f1, precision, recall); all 0 when nothing is shared, or when a yes/no/noanswer side does not match."""
    if prediction is None:
        return 0, 0, 0
    pred, gold = normalize_answer(prediction), normalize_answer(truth)
    if (pred in _CLOSED_ANSWERS or gold in _CLOSED_ANSWERS) and pred != gold:
        return 0, 0, 0
    pred_tokens, gold_tokens = pred.split(), gold.split()
    shared = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if shared == 0:
        return 0, 0, 0
    precision, recall = shared / len(pred_tokens), shared / len(gold_tokens)
    return 2 * precision * recall / (precision + recall), precision, recall


def f1_reward(response: str, label: str) -> float:
    return f1_parts(response, label)[0]
