"""Confine paths that arrive in requests and job specs to the directories the operator configured.

A path is normalised (symlinks resolved, `..` collapsed) before the check, so `data/../../etc/passwd` and a link out
of a root are refused alike. An empty list of roots means no confinement (a developer's local run).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from services.common.errors import InvalidArgument

MAX_PATH_CHARS = 4096


def confine(path: str, roots: Sequence[str], what: str) -> Path:
    """`path` resolved; InvalidArgument naming `what` if it lies outside every root (or holds a NUL)."""
    if not isinstance(path, str) or not path or "\x00" in path or len(path) > MAX_PATH_CHARS:
        raise InvalidArgument(f"{what}: not a usable path ({path[:100]!r})")
    resolved = Path(path).expanduser().resolve()
    if roots and not any(resolved.is_relative_to(Path(root).expanduser().resolve()) for root in roots):
        raise InvalidArgument(f"{what} {path[:200]!r} lies outside the allowed directories ({', '.join(roots)})")
    return resolved
