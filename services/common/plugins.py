"""Load user functions by import path ("pkg.mod.fn") once, checking their signature up front.

Only paths under a module prefix the operator allows (PHYSARUM_PLUGIN_ALLOWLIST, set by the chart's values and the
stack's flags) are imported: a job spec or a request names code, it never brings new code.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from services.common.errors import InvalidArgument

ALLOWLIST_ENV = "PHYSARUM_PLUGIN_ALLOWLIST"  # comma-separated module prefixes, e.g. "examples,mycompany.rl"


def allowed_prefixes() -> tuple[str, ...]:
    return tuple(p.strip() for p in os.environ.get(ALLOWLIST_ENV, "").split(",") if p.strip())


def check_allowed(path: str, flag: str) -> None:
    """InvalidArgument unless `path` lies under an allowed module prefix; imports nothing."""
    prefixes = allowed_prefixes()
    if not any(path.startswith(prefix + ".") for prefix in prefixes):
        allowed = ", ".join(prefixes) or "none"
        raise InvalidArgument(f"{flag}: {path[:200]!r} is not under an allowed plugin module (allowed: {allowed}; "
                              f"the operator sets {ALLOWLIST_ENV})")


# The slime compatibility package (compat/slime): what slime's plugins import, for a source checkout where it is
# not installed (pip install physarum[slime] installs it as `slime`).
COMPAT_DIR = Path(__file__).resolve().parents[2] / "compat"


def ensure_slime_compat() -> None:
    """Make `import slime` work for plugins: the installed package, else the checkout's compat/ folder."""
    if importlib.util.find_spec("slime") is None and (COMPAT_DIR / "slime").is_dir():
        sys.path.append(str(COMPAT_DIR))


def load_function(path: str, *, flag: str, expected: str, num_params: int | None = None,
                  is_async: bool | None = None) -> Callable:
    """Import `path` if the allow-list admits it; raise InvalidArgument naming the flag, the path and the expected
    signature."""
    ensure_slime_compat()
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise InvalidArgument(f"{flag}: {path!r} is not an import path 'pkg.module.function'; expected {expected}")
    check_allowed(path, flag)
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 - any import failure is the user's to see
        raise InvalidArgument(f"{flag}: cannot import module {module_name!r} ({type(err).__name__}: {err})") from err
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        raise InvalidArgument(f"{flag}: {module_name!r} has no function {attr!r}; expected {expected}")
    if is_async is not None and inspect.iscoroutinefunction(fn) != is_async:
        kind = "an async" if is_async else "a plain"
        raise InvalidArgument(f"{flag}: {path} must be {kind} function: {expected}")
    if num_params is not None:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if len(params) < num_params:
            raise InvalidArgument(f"{flag}: {path} takes {len(params)} positional parameters; expected {expected}")
    return fn


@dataclass(frozen=True)
class Signature:
    """What a hook must be: a plain function of `num_params` positional parameters (and a `keyword`), or a class."""

    expected: str
    num_params: int = 0
    keyword: str = ""
    is_class: bool = False
    methods: tuple[str, ...] = ()  # a class's methods taking (self, one argument), checked where the class defines them


# slime's rollout hooks, checked at submit (from the source) and where the rollout service loads them
ROLLOUT_FUNCTION = Signature("def generate_rollout(args, rollout_id, data_source, evaluation=False) -> "
                             "list[list[Sample]] | RolloutFnTrainOutput", num_params=3, keyword="evaluation")
DATA_SOURCE = Signature("a class of slime's DataSource interface: __init__(self, args), get_samples(self, "
                        "num_samples), add_samples(self, samples), save(self, rollout_id), load(self, rollout_id=None)",
                        is_class=True, methods=("__init__", "get_samples", "add_samples", "save", "load"))
BUFFER_FILTER = Signature("def buffer_filter(args, rollout_id, buffer, num_samples) -> list[list[Sample]]",
                          num_params=4)


def signature_problem(origin: str | None, path: str, flag: str, signature: Signature) -> str:
    """Whether module file `origin` defines `path`'s last part as `signature` says, read without importing it; ''
    when it does, or when the source cannot say (a name bound by an import or an assignment, a compiled module)."""
    attr, expected = path.rpartition(".")[2], signature.expected
    if not origin or not origin.endswith(".py"):
        return ""
    try:
        tree = ast.parse(Path(origin).read_text(), origin)
    except (OSError, SyntaxError, ValueError) as err:
        return f"{flag}: cannot read {origin} ({type(err).__name__}: {err})"
    found: ast.AST | None = None
    for stmt in tree.body:  # the last binding at the top level wins, as when the module runs
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and stmt.name == attr:
            found = stmt
        elif isinstance(stmt, (ast.Import, ast.ImportFrom)) and any(
                (alias.asname or alias.name.split(".")[0]) == attr for alias in stmt.names):
            found = stmt
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign)) and attr in {
                t.id for t in getattr(stmt, "targets", [getattr(stmt, "target", None)]) if isinstance(t, ast.Name)}:
            found = stmt
    if found is None:
        return f"{flag}: module {path.rpartition('.')[0]!r} has no {attr!r}; expected {expected}"
    if not isinstance(found, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return ""
    if signature.is_class or isinstance(found, ast.ClassDef):
        what = "a class" if isinstance(found, ast.ClassDef) else "a function"
        if signature.is_class != isinstance(found, ast.ClassDef):
            return f"{flag}: {path} is {what}; expected {expected}"
        methods = {m.name: m for m in found.body if isinstance(m, ast.FunctionDef) and m.name in signature.methods}
        short = [name for name, method in methods.items() if _num_positional(method.args) < 2]
        return "" if not short else \
            f"{flag}: {path}'s {', '.join(short)} take no argument besides self; expected {expected}"
    if isinstance(found, ast.AsyncFunctionDef):
        return f"{flag}: {path} must be a plain function (slime calls it without await): {expected}"
    params = found.args
    names = [a.arg for a in (*params.posonlyargs, *params.args)]
    if _num_positional(params) < signature.num_params:
        return f"{flag}: {path} takes {len(names)} positional parameters; expected {expected}"
    if signature.keyword and params.kwarg is None and signature.keyword not in names + [
            a.arg for a in params.kwonlyargs]:
        return f"{flag}: {path} takes no `{signature.keyword}` keyword (slime passes it); expected {expected}"
    return ""


def _num_positional(params: ast.arguments) -> float:
    """How many positional arguments a definition takes (any number with *args)."""
    return float("inf") if params.vararg is not None else len(params.posonlyargs) + len(params.args)
