"""Answer equality through sympy (the checker slime's math and deepscaler reward models use after the MATH
normalisation): normalise both, compare tuples element-wise, let sympy simplify the difference when that is safe.
"""

from __future__ import annotations

import re

import sympy
from pylatexenc import latex2text
from sympy.parsing import sympy_parser

_UNITS = ("degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week", "month",
          "year", "foot", "feet", "inch", "yard")
_UNIT_PATTERNS = [re.compile(rf"{unit}(es)?(s)? *(\^[0-9]+)?") for unit in _UNITS]
_TEXT_WRAPPED = re.compile(r"^\\text\{(?P<text>.+?)\}$")
_THOUSANDS_COMMA = re.compile(r"(\d)(,)(\d\d\d)($|\D)")
_MIXED_NUMBER = re.compile("([0-9]) +([0-9])")  # "7 3/4" -> "7+3/4"
_FRACTION = re.compile(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$")
_UNSAFE_SUBSTRINGS = ("^{", "^(")  # sympy may hang on these: no leniency there
_UNSAFE_PATTERNS = (re.compile(r"\^[0-9]+\^"), re.compile(r"\^[0-9][0-9]+"))
_BRACKETS = "()[]"
_LATEX_SYMBOLS = (("√", "sqrt"), ("π", "pi"), ("∞", "inf"), ("∪", "U"), ("·", "*"), ("×", "*"))
# sympy's public names and no builtins: parse_expr evaluates, so nothing else may be reachable
_SYMPY_NAMES = {"__builtins__": {}, **{k: v for k, v in vars(sympy).items() if not k.startswith("_")}}
_TRANSFORMS = sympy_parser.standard_transformations + (sympy_parser.implicit_multiplication_application,)


def _is_float(text: str) -> bool:
    try:
        float(text)
    except (TypeError, ValueError):
        return False
    return True


def _is_whole(value: float) -> bool:
    try:
        return abs(value - int(round(value))) <= 1e-7
    except (OverflowError, ValueError):
        return False


def _drop_thousands_commas(text: str) -> str:
    while True:
        changed = _THOUSANDS_COMMA.sub("\\1\\3\\4", text)
        if changed == text:
            return changed
        text = changed


def _str_is_int(text: str) -> bool:
    try:
        return _is_whole(float(_drop_thousands_commas(text)))
    except ValueError:
        return False


def _latex_to_text(expr: str) -> str:
    expr = expr.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac").replace("\\frac", " \\frac")
    expr = latex2text.LatexNodes2Text().latex_to_text(expr)
    for symbol, name in _LATEX_SYMBOLS:
        expr = expr.replace(symbol, name)
    return expr.strip()


def normalize(expr: str | None) -> str | None:
    """A plain-text form of the answer: units, dollars and percent signs gone, LaTeX rendered, lower case."""
    if expr is None:
        return None
    wrapped = _TEXT_WRAPPED.search(expr)
    if wrapped is not None:
        expr = wrapped.group("text")
    for old, new in (("\\%", "%"), ("\\$", "$"), ("$", ""), ("%", ""), (" or ", " , "), (" and ", " , "),
                     ("million", "*10^6"), ("billion", "*10^9"), ("trillion", "*10^12")):
        expr = expr.replace(old, new)
    for pattern in _UNIT_PATTERNS:
        expr = pattern.sub("", expr)
    expr = re.sub(r"\^ *\\circ", "", expr)
    if expr and expr[0] == "{" and expr[-1] == "}":
        expr = expr[1:-1]
    expr = re.sub(",\\\\! *", "", expr)
    if _is_float(expr) and _is_whole(float(expr)):
        expr = str(int(round(float(expr))))
    if "\\" in expr:
        try:
            expr = _latex_to_text(expr)
        except Exception:  # noqa: BLE001 - unparseable LaTeX stays as written
            pass
    expr = re.sub("- *", "-", expr)
    expr = _MIXED_NUMBER.sub("\\1+\\2", expr)
    expr = expr.replace(" ", "").replace("{", "").replace("}", "").lower()
    if _str_is_int(expr):
        expr = str(int(float(expr.replace(",", ""))))
    return expr


def _safe_to_simplify(expr: str) -> bool:
    letters = {c for c in expr.replace("sqrt", "").replace("frac", "") if c.isalpha()}
    if len(letters) > 2:
        return False
    return not any(s in expr for s in _UNSAFE_SUBSTRINGS) and not any(p.search(expr) for p in _UNSAFE_PATTERNS)


def _equal_under_sympy(truth: str, given: str) -> bool:
    expr = f"({truth})-({given})"
    if not _safe_to_simplify(expr):
        return False
    try:
        diff = sympy_parser.parse_expr(expr.replace("^", "**"), local_dict={}, global_dict=dict(_SYMPY_NAMES),
                                       transformations=_TRANSFORMS)
        return sympy.simplify(diff) == 0
    except Exception:  # noqa: BLE001 - whatever sympy cannot read is simply not equal
        return False


def _elements(expr: str) -> list[str]:
    """The elements of a tuple or interval "(a,b)", "[a,b)"; [expr] for anything else."""
    expr = _drop_thousands_commas(expr)
    if not expr:
        return []
    inner = expr[1:-1]
    if len(expr) > 2 and expr[0] in _BRACKETS and expr[-1] in _BRACKETS and not any(c in inner for c in _BRACKETS):
        return [e.strip() for e in inner.split(",")]
    return [expr]


def _elements_equal(truth: str, given: str) -> bool:
    if _FRACTION.search(truth) and _FRACTION.search(given):
        return truth == given  # an unreduced fraction is not the answer
    if _str_is_int(truth) != _str_is_int(given):
        return False  # an integer answer must match exactly
    return _equal_under_sympy(truth, given)


def grade(given: str | None, truth: str | None) -> bool:
    """slime's grade_answer_sympy."""
    truth_n, given_n = normalize(truth), normalize(given)
    if truth_n is None:
        return False
    if truth_n == given_n:
        return True
    if not given_n:
        return False
    truth_elems, given_elems = _elements(truth_n), _elements(given_n)
    if len(truth_elems) > 1 and (truth_n[0] != given_n[0] or truth_n[-1] != given_n[-1]):
        return False  # "(1,2)" against "[1,2]"
    if len(truth_elems) != len(given_elems):
        return False
    return all(_elements_equal(t, g) for t, g in zip(truth_elems, given_elems, strict=True))
