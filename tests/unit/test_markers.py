"""tests/conftest.py marks every test unit, integration or e2e by its folder, which `make test-fast` selects on."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from tests.conftest import TESTS, pytest_collection_modifyitems


def item(path: Path) -> SimpleNamespace:
    marks: list[str] = []
    return SimpleNamespace(fspath=str(path), marks=marks, add_marker=marks.append)


def test_each_folder_gets_its_marker_and_files_outside_tests_get_none(tmp_path):
    items = [item(TESTS / "unit" / "test_x.py"), item(TESTS / "chart" / "test_render.py"),
             item(TESTS / "integration" / "test_router.py"), item(TESTS / "e2e" / "test_loop.py"),
             item(TESTS / "plugins" / "reward_fns.py"), item(tmp_path / "test_elsewhere.py")]
    pytest_collection_modifyitems(None, items)
    assert [i.marks for i in items] == [["unit"], ["unit"], ["integration"], ["e2e"], [], []]


def test_the_slow_integration_modules_are_marked_slow_too():
    folder = TESTS / "integration"
    items = [item(folder / "test_weight_sync.py"), item(folder / "test_weight_sync_pool.py")]
    pytest_collection_modifyitems(None, items)
    assert [i.marks for i in items] == [["integration", "slow"], ["integration"]]
