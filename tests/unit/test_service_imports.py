"""The import graph of services/, read from the source: no service imports the CLI package (physarum/), a service
imports another only through its `client` module or services.common, and the checked services hold no import circle."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ROOT / "services"
CHECKED = ("buffer", "common", "engine", "reward", "rollout")  # the trainer joins once its reshape lands


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Modules `path` imports (`from a import b` counts a.b when that is a module), at any depth in the file."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in SERVICES.rglob("*.py") if "gen" not in p.relative_to(SERVICES).parts}
    return {name: {m for m in imports_of(path) if m in files or m.split(".")[0] == "physarum"}
            for name, path in files.items()}


def service_of(module: str) -> str:
    return module.split(".")[1] if module.count(".") >= 1 else ""


def test_no_service_imports_the_cli_package():
    offenders = sorted(f"{m} imports {i}" for m, deps in graph().items() for i in deps if i.startswith("physarum"))
    assert not offenders, offenders


def test_services_meet_only_through_client_modules_and_common():
    offenders = []
    for module, deps in graph().items():
        for dep in deps:
            other = service_of(dep)
            if dep.startswith("services.") and other not in (service_of(module), "common"):
                if dep not in (f"services.{other}", f"services.{other}.client"):
                    offenders.append(f"{module} imports {dep}")
    assert not [o for o in offenders if not o.startswith("services.trainer")], sorted(offenders)


def test_no_import_circle_in_the_checked_services():
    edges = {m: deps for m, deps in graph().items() if service_of(m) in CHECKED}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    circles: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in sorted(edges.get(module, ())):
            if state.get(dep) == 1:
                circles.append(path[path.index(dep):] + [dep])
            elif dep in edges and dep not in state:
                visit(dep, path + [dep])
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    assert not circles, circles
