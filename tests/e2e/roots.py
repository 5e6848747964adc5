"""Where the end-to-end tests' stacks let jobs read and write: this pytest run's private base directory (every
test's tmp_path is under it; it is not world-writable, as the temporary directory is) and the repository (the
examples' files)."""

from __future__ import annotations

from pathlib import Path


def stack_roots(session_dir: Path) -> tuple[Path, ...]:
    return (Path(session_dir).parent, Path.cwd())
