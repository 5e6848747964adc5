"""The import graph of services/, read with ast (nothing is imported): no circles, and across services only
`services.<svc>.client` and `services.common` are imported; nothing imports the CLI package `physarum`; only the
trainer and the engine import torch."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, name: str, modules: set[str]) -> set[str]:
    """The project modules `path` imports anywhere in it (top level, functions, TYPE_CHECKING blocks)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:  # `from pkg import mod` imports the module pkg.mod
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {m for m in found if m.split(".")[0] in ("services", "physarum")}


def import_graph(root: Path) -> dict[str, set[str]]:
    paths = {module_name(p, root): p for p in sorted((root / "services").rglob("*.py"))
             if "gen" not in p.relative_to(root).parts}
    modules = set(paths) | {module_name(p, root) for p in (root / "physarum").rglob("*.py")}
    return {name: imports_of(path, name, modules) for name, path in paths.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in graph:
                continue
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph.get(node, ()):
                out.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return out


def service_of(module: str) -> str:
    return module.split(".")[1] if module.startswith("services.") and module.count(".") >= 1 else module


def forbidden_imports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """(importer, imported) pairs that reach into another service's internals or into the CLI package."""
    bad = set()
    for importer, imported in ((a, b) for a, targets in graph.items() for b in targets):
        if imported.split(".")[0] == "physarum":
            bad.add((importer, imported))
            continue
        mine, theirs = service_of(importer), service_of(imported)
        if imported in ("services", f"services.{theirs}") or theirs in (mine, "common"):
            continue
        if imported != f"services.{theirs}.client":
            bad.add((importer, imported))
    return bad


# services/trainer's folders from the ground up: a folder imports only its own floor and those below it.
TRAINER_FLOORS = (("algorithms", "distributed", "batching", "models", "lora"), ("settings", "checkpoint", "moe"),
                  ("step",), ("backends",), ("weight_sync", "slime_flags"), ("driver",), ("dashboard",), ("api",),
                  ("ranks",), ("__main__",))


def trainer_floor(module: str) -> int | None:
    parts = module.split(".")
    if parts[:2] != ["services", "trainer"] or len(parts) < 3:
        return None
    return next((i for i, names in enumerate(TRAINER_FLOORS) if parts[2] in names), None)


def imports_running_up(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """(importer, imported) pairs inside services/trainer where a folder imports one on a floor above it, and any
    import from services.common into another service (the shared package, job settings included, stands below
    every service)."""
    bad = set()
    for importer, imported in ((a, b) for a, targets in graph.items() for b in targets):
        low, high = trainer_floor(importer), trainer_floor(imported)
        if low is not None and high is not None and high > low:
            bad.add((importer, imported))
        if service_of(importer) == "common" and service_of(imported) not in ("common", "services"):
            bad.add((importer, imported))
    return bad


def write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_services_have_no_import_circles():
    assert circles(import_graph(ROOT)) == []


def test_services_import_only_clients_and_common_across_services():
    bad = forbidden_imports(import_graph(ROOT))
    assert bad == set(), "import another service's client.py or services.common instead"


def test_no_import_runs_up_the_trainers_floors_or_out_of_common():
    assert imports_running_up(import_graph(ROOT)) == set()


def torch_importers(root: Path) -> set[str]:
    """The services' modules that import torch anywhere in them."""
    found = set()
    for path in sorted((root / "services").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            if any(name == "torch" or name.startswith("torch.") for name in names):
                found.add(module_name(path, root))
    return found


def test_only_the_trainer_and_the_engine_import_torch():
    assert {m for m in torch_importers(ROOT) if service_of(m) not in ("trainer", "engine")} == set()


def test_every_trainer_folder_has_a_floor():
    folders = {p.name for p in (ROOT / "services" / "trainer").iterdir() if (p / "__init__.py").is_file()}
    assert folders == {name for names in TRAINER_FLOORS for name in names} - {"__main__"}


def test_an_import_up_a_floor_is_found(tmp_path):
    root = write(tmp_path, {"services/__init__.py": "", "services/trainer/__init__.py": "",
                            "services/common/__init__.py": "", "services/reward/__init__.py": "",
                            "services/reward/client.py": "", "services/trainer/api/__init__.py": "",
                            "services/trainer/api/jobs.py": "from services.trainer.driver import loop\n",
                            "services/trainer/driver/__init__.py": "",
                            "services/trainer/driver/loop.py": "from services.trainer.api.jobs import JobContext\n",
                            "services/common/x.py": "from services.reward.client import RM_TYPES\n",
                            "physarum/__init__.py": ""})
    assert imports_running_up(import_graph(root)) == {("services.trainer.driver.loop", "services.trainer.api.jobs"),
                                                      ("services.common.x", "services.reward.client")}


def test_a_circle_through_a_function_level_or_relative_import_is_found(tmp_path):
    root = write(tmp_path, {"services/__init__.py": "", "services/a/__init__.py": "",
                            "services/a/x.py": "def f():\n    from services.a import y\n",
                            "services/a/y.py": "from .z import g\n",
                            "services/a/z.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                               "    import services.a.x\n",
                            "services/a/w.py": "import services.a.x\n", "physarum/__init__.py": ""})
    assert circles(import_graph(root)) == [["services.a.x", "services.a.y", "services.a.z"]]


def test_internals_of_another_service_and_the_cli_are_forbidden(tmp_path):
    root = write(tmp_path, {"services/__init__.py": "", "services/a/__init__.py": "", "services/b/__init__.py": "",
                            "services/common/__init__.py": "", "services/common/util.py": "",
                            "services/b/client.py": "", "services/b/pool.py": "", "physarum/__init__.py": "",
                            "physarum/procs.py": "",
                            "services/a/ok.py": "from services.b.client import C\nfrom services.common import util\n",
                            "services/a/bad.py": "from services.b import pool\nfrom physarum.procs import p\n"})
    assert forbidden_imports(import_graph(root)) == {("services.a.bad", "services.b.pool"),
                                                     ("services.a.bad", "physarum.procs")}
