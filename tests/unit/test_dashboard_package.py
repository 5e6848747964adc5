"""The dashboard's static files ship in the package: pyproject's package-data globs cover every one of them, and the
vendored chart library keeps its license and the version its pages load."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "services.trainer.dashboard"
PACKAGE_DIR = ROOT / "services" / "trainer" / "dashboard"


def test_every_static_file_is_package_data():
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][PACKAGE]
    covered = {path for pattern in globs for path in PACKAGE_DIR.glob(pattern) if path.is_file()}
    static = {path for path in (PACKAGE_DIR / "static").rglob("*") if path.is_file()}
    assert static and static == covered, sorted(str(p.relative_to(PACKAGE_DIR)) for p in static - covered)


def test_the_vendored_uplot_is_pinned_and_licensed():
    vendor = PACKAGE_DIR / "static" / "vendor"
    (version_dir,) = vendor.iterdir()
    assert version_dir.name.startswith("uplot-")
    assert "MIT License" in (version_dir / "LICENSE").read_text()
    page = (PACKAGE_DIR / "static" / "index.html").read_text()
    assert f"vendor/{version_dir.name}/uPlot.iife.min.js" in page and f"vendor/{version_dir.name}/uPlot.min.css" in page
