"""slime.rollout.rm_hub.math_utils: boxed-answer extraction and the MATH / sympy answer checks."""

from __future__ import annotations

from typing import Any

from services.reward.rm import hendrycks, sympy_grade
from services.reward.rm.boxed import boxed_answer as extract_answer
from services.reward.rm.boxed import last_boxed_command as last_boxed_only_string
from services.reward.rm.boxed import unbox as remove_boxed
from services.reward.rm.math import math_reward

grade_answer_mathd = hendrycks.grade
grade_answer_sympy = sympy_grade.grade
mathd_normalize_answer = hendrycks.normalize


def extract_boxed_answer(solution: str) -> str | None:
    return remove_boxed(last_boxed_only_string(solution))


def grade_answer_verl(solution_str: str, ground_truth: Any) -> bool:
    return bool(math_reward(solution_str, ground_truth))


__all__ = ["extract_answer", "extract_boxed_answer", "grade_answer_mathd", "grade_answer_sympy", "grade_answer_verl",
           "last_boxed_only_string", "mathd_normalize_answer", "remove_boxed"]
