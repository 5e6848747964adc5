"""slime's `math` and `deepscaler` reward models: the last \\boxed{} answer, equal to the label under the MATH
normalisation or under sympy. Both score 1 or 0.
"""

from __future__ import annotations

from typing import Any

from services.reward.rm import hendrycks, sympy_grade
from services.reward.rm.boxed import boxed_answer


def _equal(given: str | None, truth: str | None) -> bool:
    return hendrycks.grade(given, truth) or sympy_grade.grade(given, truth)


def math_reward(response: str, label: Any) -> int:
    """rm_type math: the response's last \\boxed{} against the label (itself unboxed when it has a \\boxed)."""
    if not label:
        return 0
    truth: str | None = str(label)
    if "\\boxed" in truth:
        truth = boxed_answer(truth)
    given = boxed_answer(response)
    if given is None:
        return 0
    return int(_equal(given, truth))


def deepscaler_reward(response: str, label: Any) -> int:
    """rm_type deepscaler: like math, but only the text after the last </think> (or after "###Response") counts;
    a response with neither scores 0."""
    if "</think>" in response:
        solution = response.split("</think>")[-1]
    elif "###Response" in response:
        solution = response.split("###Response")[1]
    else:
        return 0
    given = boxed_answer(solution)
    if given is None or label == "":
        return 0
    if not isinstance(label, (str, float, int)):
        raise TypeError(f"deepscaler: the label must be a string or a number, got {type(label).__name__}")
    truth: str | None = str(label)
    if "\\boxed" in truth:
        truth = boxed_answer(truth)
        if truth is None:
            return 0
    return int(_equal(given, truth))
