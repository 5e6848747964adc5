"""Built-in scorers (slime's --rm-type): plain functions (response, label) -> float, picked by name.

They run in worker threads; math-verify's own signal-based timeouts are off, the caller's per-sample timeout rules.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

from math_verify import parse, verify

from services.common.errors import InvalidArgument

logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled" warnings: we time out ourselves

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER = re.compile(r"answer\s*:", re.IGNORECASE)
_NUMBER = re.compile(r"(?<![\d)])-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} in text, braces balanced; None if there is none (or it is unclosed)."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    depth, start = 1, starts[-1]
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return None


def extract_answer(response: str) -> str | None:
    """The last \\boxed{} answer, else the line after the last "Answer:", else the last number; None if none."""
    boxed = last_boxed(response)
    if boxed is not None:
        return boxed
    answers = list(_ANSWER.finditer(response))
    if answers:
        line = response[answers[-1].end():].strip().split("\n", 1)[0].strip().rstrip(".").strip("$ ")
        if line:
            return line
    numbers = _NUMBER.findall(response)
    return numbers[-1].rstrip(",") if numbers else None


def _parse(answer: str) -> list:
    return parse(f"\\boxed{{{answer}}}", parsing_timeout=None)


def math(response: str, label: str) -> float:
    """1.0 if the response's final answer equals the label mathematically (math-verify), else 0.0."""
    answer = extract_answer(response)
    if answer is None:
        return 0.0
    gold = _parse(last_boxed(label) or label)
    target = _parse(answer)
    if not gold or not target:
        return 0.0
    return 1.0 if verify(gold, target, timeout_seconds=None) else 0.0


def exact_match(response: str, label: str) -> float:
    """1.0 if response and label are equal after stripping surrounding whitespace, else 0.0."""
    return 1.0 if response.strip() == label.strip() else 0.0


BUILTIN_SCORERS: dict[str, Callable[[str, str], float]] = {"exact_match": exact_match, "math": math}


def builtin_scorer(rm_type: str) -> Callable[[str, str], float]:
    """The built-in scorer named rm_type; InvalidArgument listing the valid names otherwise."""
    scorer = BUILTIN_SCORERS.get(rm_type)
    if scorer is None:
        valid = ", ".join(sorted(BUILTIN_SCORERS))
        got = f"unknown rm_type {rm_type!r}" if rm_type else "rm_type is empty"
        raise InvalidArgument(f"{got}; expected one of {valid}, or set custom_rm_path")
    return scorer
