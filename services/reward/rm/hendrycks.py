"""The MATH dataset's string normalisation (Hendrycks et al.): two answers match when their normal forms are equal.

Each step mirrors the reference checker, quirks included (a step that cannot apply leaves the answer as it was),
so scores equal slime's `grade_answer_mathd`.
"""

from __future__ import annotations

import re

_TEXT_WRAPPED = re.compile(r"^\\text\{(?P<text>.+?)\}$")


class _Unchanged(Exception):
    """A step met input it cannot handle: the whole normalisation keeps the answer as it was."""


def _braced_fracs(text: str) -> str:
    r"""\frac12 -> \frac{1}{2}, \frac1{72} -> \frac{1}{72}; a \frac with under two characters after it stops it."""
    head, *tails = text.split("\\frac")
    out = [head]
    for tail in tails:
        if not tail:
            raise _Unchanged
        out.append("\\frac")
        if tail[0] == "{":
            out.append(tail)
            continue
        if len(tail) < 2:
            return text
        first, second, rest = tail[0], tail[1], tail[2:]
        out.append(f"{{{first}}}{{{second}}}{rest}" if second != "{" else f"{{{first}}}{second}{rest}")
    return "".join(out)


def _slash_to_frac(text: str) -> str:
    """ "3/4" -> \\frac{3}{4}, only for two plain integers."""
    parts = text.split("/")
    if len(parts) != 2:
        return text
    try:
        a, b = int(parts[0]), int(parts[1])
    except ValueError:
        return text
    return f"\\frac{{{a}}}{{{b}}}" if text == f"{a}/{b}" else text


def _drop_right_units(text: str) -> str:
    r"""Everything before "\text{ " (units); more than one such unit is not handled."""
    if "\\text{ " not in text:
        return text
    parts = text.split("\\text{ ")
    if len(parts) != 2:
        raise _Unchanged
    return parts[0]


def _braced_sqrt(text: str) -> str:
    r"""\sqrt3 -> \sqrt{3}."""
    if "\\sqrt" not in text:
        return text
    head, *tails = text.split("\\sqrt")
    out = [head]
    for tail in tails:
        if not tail:
            raise _Unchanged
        out.append("\\sqrt" + tail if tail[0] == "{" else "\\sqrt{" + tail[0] + "}" + tail[1:])
    return "".join(out)


_PLAIN_REPLACEMENTS = (("\n", ""), ("\\!", ""), ("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac"),
                       ("\\left", ""), ("\\right", ""), ("^{\\circ}", ""), ("^\\circ", ""), ("\\$", ""))


def _strip(text: str) -> str:
    for old, new in _PLAIN_REPLACEMENTS:
        text = text.replace(old, new)
    text = _drop_right_units(text)
    text = text.replace("\\%", "")
    text = text.replace(" .", " 0.").replace("{.", "{0.")
    if not text:
        return text
    if text[0] == ".":
        text = "0" + text
    sides = text.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # "k = 5" -> "5"
        text = sides[1]
    text = _braced_sqrt(text).replace(" ", "")
    text = _braced_fracs(text)
    if text == "0.5":
        text = "\\frac{1}{2}"
    return _slash_to_frac(text)


def normalize(answer: str | None) -> str | None:
    """The answer's normal form; None stays None."""
    if answer is None:
        return None
    answer = answer.strip()
    wrapped = _TEXT_WRAPPED.search(answer)
    if wrapped is not None:
        answer = wrapped.group("text").strip()
    try:
        return _strip(answer)
    except _Unchanged:
        return answer


def grade(given: str | None, truth: str | None) -> bool:
    """slime's grade_answer_mathd: equal normal forms."""
    return normalize(truth) == normalize(given)
