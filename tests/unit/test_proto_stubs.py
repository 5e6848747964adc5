"""The committed gRPC stubs are exactly what `make proto` generates from proto/ now."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_committed_stubs_are_not_stale(tmp_path):
    spec = importlib.util.spec_from_file_location("generate", ROOT / "proto" / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    generate.generate(tmp_path)
    committed = ROOT / "services" / "common" / "gen"
    fresh = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*.py*") if p.is_file()}
    old = {p.relative_to(committed): p.read_bytes() for p in committed.rglob("*.py*")
           if p.is_file() and "__pycache__" not in p.parts}
    assert fresh.keys() == old.keys(), "stub files differ: run `make proto`"
    stale = [str(name) for name, data in fresh.items() if old[name] != data]
    assert not stale, f"stale stubs (run `make proto`): {stale}"
