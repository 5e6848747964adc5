"""The manual builds as a site: `mkdocs build --strict` (what `make docs` runs) succeeds on README.md and docs/, and
fails on a broken anchor, so a link, anchor or README include that breaks stops the build.

mkdocs is a dev dependency: where it is missing the build fails and so does this test (it does not skip).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def build(root: Path, site: Path) -> subprocess.CompletedProcess:
    """`mkdocs build --strict` of root's mkdocs.yml, run from root (the README includes are relative to it)."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=root, env=env, capture_output=True, text=True, timeout=240)


def nav_pages(nav: list) -> list[str]:
    """The .md files mkdocs.yml's nav lists, in order."""
    pages = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_the_site_builds_strict_with_every_page_in_the_nav(tmp_path):
    result = build(ROOT, tmp_path / "site")
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    pages = nav_pages(config["nav"])
    assert sorted(pages) == sorted(p.name for p in (ROOT / "docs").glob("*.md")), "a docs page is missing from the nav"
    for page in pages:
        html = tmp_path / "site" / ("index.html" if page == "index.md" else f"{page[:-3]}/index.html")
        assert html.is_file(), f"{page} was not built"
    home = (tmp_path / "site" / "index.html").read_text()
    assert 'id="services"' in home and 'id="the-demo"' in home and "0.000 -&gt; 0.545 -&gt; 0.725" in home, (
        "the home page lacks the README's sections it includes")


def test_a_broken_anchor_fails_the_build(tmp_path):
    """The check can fail: a link to a heading that does not exist stops a strict build."""
    for name in ("mkdocs.yml", "README.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    page = tmp_path / "docs" / "jobs.md"
    page.write_text(page.read_text() + "\nSee [nowhere](kubernetes.md#no-such-heading).\n")
    result = build(tmp_path, tmp_path / "site")
    assert result.returncode != 0 and "no-such-heading" in result.stdout + result.stderr
