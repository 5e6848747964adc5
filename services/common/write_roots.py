"""Where the trainer writes (checkpoints; exports and dumps), checked when it writes, not only when the job was
submitted: a directory replaced by a symlink while the job waited is resolved again and refused if it now leads
outside the roots, and files are created with O_NOFOLLOW. The roots are the trainer's own flags, set once per
process (`configure`); none configured: unconfined (a developer's local run).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO

from services.common.errors import InvalidArgument
from services.common.paths import confine

CHECKPOINTS, EXPORTS = "checkpoints", "exports"
_ROOTS: dict[str, tuple[str, ...]] = {CHECKPOINTS: (), EXPORTS: ()}


def configure(checkpoints: list[str] | tuple[str, ...], exports: list[str] | tuple[str, ...]) -> None:
    """This process's roots (the trainer's --checkpoint-roots and --export-roots)."""
    _ROOTS[CHECKPOINTS], _ROOTS[EXPORTS] = tuple(checkpoints), tuple(exports)


def roots(kind: str) -> tuple[str, ...]:
    return _ROOTS[kind]


def writable_dir(path: str | Path, kind: str, what: str) -> Path:
    """`path` resolved now, created if missing, and checked against the `kind` roots before and after it is created
    (a link put in its place meanwhile is caught); InvalidArgument naming `what` if it lies outside them."""
    resolved = confine(str(path), _ROOTS[kind], what)
    resolved.mkdir(parents=True, exist_ok=True)
    return confine(str(resolved), _ROOTS[kind], what)


def open_for_write(path: str | Path, kind: str, what: str) -> BinaryIO:
    """A new (or truncated) file at `path` for binary writing, its directory checked as writable_dir does and the
    file itself opened with O_NOFOLLOW: a symlink at the file's name is refused, not followed."""
    path = Path(path)
    directory = writable_dir(path.parent, kind, what)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(directory / path.name, flags, 0o600)
    except OSError as err:
        raise InvalidArgument(f"{what} {str(path)[:200]!r}: cannot be written ({err.strerror}; a symlink is "
                              "refused)") from None
    return os.fdopen(fd, "wb")
