"""The command line the fuzz and chaos runs share: --quick, --seed, --work-dir (a temporary one by default), and the
summary printed as one JSON line; each run judges its own summary."""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path


def run_from_args(argv: Sequence[str] | None, *, prog: str, description: str, quick_help: str,
                  run: Callable[[Path, argparse.Namespace], dict],
                  add_arguments: Callable[[argparse.ArgumentParser], None] | None = None) -> dict:
    """Parse `argv` (the shared flags and those `add_arguments` adds), call `run(work_dir, args)`, print its summary
    as JSON and return it."""
    parser = argparse.ArgumentParser(prog=f"python -m {prog}", description=description)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work-dir", type=Path, default=None)
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix=f"physarum-{prog.rsplit('.', 1)[-1]}-") as tmp:
        summary = run(args.work_dir or Path(tmp), args)
    print(json.dumps(summary), flush=True)
    return summary
