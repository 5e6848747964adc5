"""The pull transport's reading side: the way from the version an engine holds to a target version through shared
storage (`services.common.weight_delta`'s layout): the deltas after the engine's version when they reach the target,
else the newest full snapshot from which deltas reach it. Plans only; applying is `weights.WeightUpdater.pull`'s.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from services.common import weight_delta
from services.common.errors import InvalidArgument, NotFound

log = logging.getLogger(__name__)

MAX_CHAIN = 10_000  # deltas followed at most (a loop in a damaged store must not hang the engine)


@dataclass(frozen=True)
class Step:
    version: str  # what the engine holds after it
    path: Path
    full: bool

    def describe(self) -> str:
        return f"{'full' if self.full else 'delta'} {self.version}"


def _deltas(root: Path) -> dict[str, tuple[str, Path]]:
    """base version -> (version, file) of every readable delta under root."""
    out = {}
    for path in sorted((root / weight_delta.DELTA_DIR).glob("*.delta")):
        try:
            header = weight_delta.read_header(path)
        except (OSError, weight_delta.ChecksumError) as err:  # a damaged or vanishing file is a missing delta
            log.warning("skipping delta %s: %s", path, err)
            continue
        out[str(header["base_version"])] = (str(header["version"]), path)
    return out


def _chain(deltas: dict[str, tuple[str, Path]], start: str, target: str) -> list[Step] | None:
    steps, version = [], start
    while version != target:
        if version not in deltas or len(steps) >= MAX_CHAIN:
            return None
        version, path = deltas[version]
        steps.append(Step(version, path, full=False))
    return steps


def is_delta_store(path: str | Path) -> bool:
    """Whether `path` is a pull transport's root (full snapshots under full/), not a checkpoint directory."""
    root = Path(path)
    return (root / weight_delta.FULL_DIR).is_dir() and not any(root.glob("*.safetensors"))


def plan(source_dir: str | Path, current: str | None, target: str) -> list[Step]:
    """The steps taking an engine at `current` (None: its weights match no version) to `target`."""
    root = Path(source_dir)
    weight_delta.check_version(target)
    if not root.is_dir():
        raise InvalidArgument(f"pull_weights: source_dir {str(root)!r} is not a directory")
    if current == target:
        return []
    deltas = _deltas(root)
    if current is not None and (steps := _chain(deltas, current, target)) is not None:
        return steps
    fulls = sorted((p for p in (root / weight_delta.FULL_DIR).glob("[!.]*") if (p / "model.safetensors").is_file()),
                   key=lambda p: p.stat().st_mtime, reverse=True)
    for full in fulls:
        if (steps := _chain(deltas, full.name, target)) is not None:
            return [Step(full.name, full, full=True), *steps]
    raise NotFound(f"pull_weights: no full snapshot under {root} from which deltas reach version {target!r} "
                   f"(this engine holds {current!r}); a full snapshot is needed")


def read_delta(path: Path) -> memoryview:
    """A delta file's bytes; a file gone since planning reads as a missing delta."""
    try:
        return memoryview(path.read_bytes())
    except OSError as err:
        raise NotFound(f"pull_weights: delta {path} unreadable: {err}") from err
