"""Backends are asked what they can do, never compared by name: outside the backend registry (capabilities.py,
registry.py) no code of services/ or physarum/ compares a value with a backend's name; a layout or a job a backend
cannot run is refused naming the backends that can."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import get_args

import pytest

from services.trainer.backends.capabilities import BACKENDS, BackendName, backends_that, capabilities
from services.trainer.backends.layout import LayoutConfig

ROOT = Path(__file__).resolve().parents[2]
REGISTRY = {ROOT / "services/trainer/backends/capabilities.py", ROOT / "services/trainer/backends/registry.py"}


def names_in(node: ast.AST) -> set[str]:
    """The backend names a comparison operand spells out: a string, or a tuple, list or set of strings."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return {item.value for item in items if isinstance(item, ast.Constant) and item.value in BACKENDS}


# settings whose values merely share a backend's name: slime's opd_type megatron is a teacher model in the trainer
NOT_BACKENDS = {"opd_type"}


def names_other_setting(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr in NOT_BACKENDS) or \
        (isinstance(node, ast.Name) and node.id in NOT_BACKENDS)


def name_comparisons(source: str) -> list[int]:
    """Lines where a value is compared (==, !=, in, not in) with a backend's name."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        if any(names_in(operand) for operand in operands) and not any(map(names_other_setting, operands)):
            lines.append(node.lineno)
    return lines


def test_no_code_outside_the_registry_compares_a_backend_name():
    found = {}
    for path in sorted([*(ROOT / "services").rglob("*.py"), *(ROOT / "physarum").rglob("*.py")]):
        if path in REGISTRY or "gen" in path.relative_to(ROOT).parts:
            continue
        if lines := name_comparisons(path.read_text()):
            found[str(path.relative_to(ROOT))] = lines
    assert found == {}, "ask services.trainer.backends.capabilities instead of comparing a backend's name"


def test_a_name_comparison_is_found():
    source = ('if backend == "fsdp": pass\nok = "megatron" != name\nx = name in ("fsdp", "megatron")\n'
              'y = name in ("gloo", "nccl")\nz = spec.megatron\nt = config.opd_type == "megatron"\n')
    assert name_comparisons(source) == [1, 2, 3]


def test_every_backend_name_declares_its_capabilities():
    assert set(BACKENDS) == set(get_args(BackendName))


def test_capabilities_as_declared():
    assert backends_that(lambda caps: caps.critic) == ["fsdp", "megatron"]
    assert backends_that(lambda caps: caps.tensor_parallel) == ["megatron"]
    assert backends_that(lambda caps: caps.packing) == ["fsdp", "megatron"]
    assert backends_that(lambda caps: caps.context_parallel) == ["fsdp", "megatron"]
    assert backends_that(lambda caps: caps.reads_shares) == ["fsdp"]


def test_an_unknown_backend_is_named():
    with pytest.raises(Exception, match="train_backend 'deepspeed': expected one of fsdp, megatron"):
        capabilities("deepspeed")


@pytest.mark.parametrize(("settings", "message"), [
    ({"tensor_model_parallel_size": 2}, "tensor_model_parallel_size: train_backend fsdp cannot run"),
    ({"expert_model_parallel_size": 2, "megatron": {"x": 1}},
     "expert_model_parallel_size and megatron: .* they need train_backend: megatron"),
])
def test_a_layout_the_backend_cannot_run_names_the_one_that_can(settings, message):
    with pytest.raises(ValueError, match=message):
        LayoutConfig(train_backend="fsdp", **settings)
    assert LayoutConfig(train_backend="megatron", **settings).capabilities.tensor_parallel
