"""slime's `dapo` reward model (Minerva's answer check): the last "Answer: ..." line of the response's last 300
characters, normalised, against the label as an integer. Returns slime's dict: score 1.0 / -1.0, acc, pred.
"""

from __future__ import annotations

import re
from typing import Any

from services.reward.rm.boxed import balanced_from, unbox

_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_REPLACED = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), (r"\ ", ""), (" ", ""), ("mbox", "text"),
              (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))
_REMOVED = ("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
            "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
            "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
            "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;",
            r",\!", "{,}", '"', "\\dots", "<|im_end|>", "<|endoftext|>")
_UNWRAP = [(re.compile(r"(.*?)(\$)(.*?)(\$)(.*)"), "$\\3$"), (re.compile(r"(\\text\{)(.*?)(\})"), "\\2"),
           (re.compile(r"(\\textbf\{)(.*?)(\})"), "\\2"), (re.compile(r"(\\overline\{)(.*?)(\})"), "\\2"),
           (re.compile(r"(\\boxed\{)(.*)(\})"), "\\2"), (re.compile(r"(frac)([^{])(.)"), "frac{\\2}{\\3}"),
           (re.compile(r"(sqrt)([^{])"), "sqrt{\\2}")]


def normalize_final_answer(answer: Any) -> str:
    """The answer after its last "=", without units, words and TeX wrappers; digits lose their commas."""
    answer = str(answer).split("=")[-1]
    for old, new in _REPLACED:
        answer = answer.replace(old, new)
    for removed in _REMOVED:
        answer = answer.replace(removed, "")
    for pattern, replacement in _UNWRAP:
        answer = pattern.sub(replacement, answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def dapo_reward(response: str, label: Any, *, strict_box: bool = False) -> dict[str, Any]:
    """{"score": 1.0 or -1.0, "acc": bool, "pred": the normalised answer}; raises ValueError for a label that is
    not a number (DAPO's answers are integers). strict_box: the last \\boxed{} of the last 100 characters must
    equal the label as written (pred is None without one)."""
    tail = response[-300:]
    if strict_box:
        command = balanced_from(tail[-100:], tail[-100:].rfind("\\boxed{")) if "\\boxed{" in tail[-100:] else None
        pred = unbox(command)
        correct = pred == label
        return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
    found = _ANSWER_LINE.findall(tail)
    pred = normalize_final_answer(found[-1] if found else "[INVALID]")
    truth = str(int(float(normalize_final_answer(label))))
    correct = pred == truth
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
