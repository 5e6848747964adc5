"""The demo's tiny model and task files, built on first use: the demo trains it, and `physarum up` without --model
starts on it."""

from __future__ import annotations

from pathlib import Path

from physarum import tasks, tinymodel
from physarum.families import DEFAULT_FAMILY

DEMO_DIR = Path(".physarum/demo")


def demo_model(seed: int = 0, family: str = "") -> tuple[Path, Path]:
    """The demo's tiny model of `family` (default: the demo's; built when missing) and its task files (the job files
    name them); returns the model's directory and the held-out test set. `physarum up` without --model starts on the
    default family's seed 0."""
    family = family or DEFAULT_FAMILY
    model_dir = tinymodel.build_tiny_model(DEMO_DIR / model_name(family, seed), tasks.corpus(), seed=seed,
                                           family=family)
    _, test_path = tasks.write_addition_task(DEMO_DIR / "task")
    return model_dir, test_path


def model_name(family: str, seed: int) -> str:
    """The demo model's directory name: `model` for the default family at seed 0 (`physarum up --model` names it)."""
    name = "model" if family == DEFAULT_FAMILY else f"model-{family}"
    return name if seed == 0 else f"{name}-seed{seed}"
