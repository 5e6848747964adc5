"""The images' build context (the repository's root) leaves out what no image takes: the virtualenv, the images'
own storage, bytecode; and keeps every path a Dockerfile copies."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = [*sorted((ROOT / "deploy" / "docker").glob("*.Dockerfile")), ROOT / "deploy" / "plugins" / "Dockerfile"]


def ignored(path: str, patterns: list[str]) -> bool:
    """Whether a context path is left out, as Docker reads the file: a pattern matches the path or a folder above
    it; `**/name` matches `name` at any depth (no `!` rules here)."""
    parts = path.split("/")
    for i in range(1, len(parts) + 1):
        prefix, name = "/".join(parts[:i]), parts[i - 1]
        for pattern in patterns:
            anywhere = pattern.startswith("**/")
            if fnmatch.fnmatch(name if anywhere else prefix, pattern.removeprefix("**/")):
                return True
    return False


def patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def test_the_context_leaves_out_the_virtualenv_the_image_storage_and_bytecode():
    rules = patterns()
    assert not any(rule.startswith("!") for rule in rules)
    for path in (".venv/bin/python", ".physarum/images/storage", ".git/HEAD", "services/__pycache__/x.pyc",
                 "services/trainer/api/__pycache__/jobs.cpython-311.pyc", "physarum.egg-info/PKG-INFO"):
        assert ignored(path, rules), path


def test_every_path_a_dockerfile_copies_stays_in_the_context():
    rules = patterns()
    sources = set()
    for dockerfile in DOCKERFILES:
        for line in dockerfile.read_text().splitlines():
            if match := re.match(r"(?:COPY|ADD)\s+(?!--)(.+)\s+\S+$", line):
                sources.update(match.group(1).split())
    sources = {"examples" if source == "${PLUGIN_DIR}" else source for source in sources}  # the images-test's plugins
    assert {"services", "compat/slime", "pyproject.toml", "deploy/docker/constraints.txt"} <= sources
    for source in sources:
        assert (ROOT / source).exists(), source
        assert not ignored(source, rules), source
        assert not ignored(f"{source}/x.py", rules) or (ROOT / source).is_file(), source
