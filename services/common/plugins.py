"""Load user functions by import path ("pkg.mod.fn") once, checking their signature up front.

Only paths under a module prefix the operator allows (PHYSARUM_PLUGIN_ALLOWLIST, set by the chart's values and the
stack's flags) are imported: a job spec or a request names code, it never brings new code.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
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
