"""slime.utils.misc: load_function and SingletonMeta, as plugins use them."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any


@functools.cache
def load_function(path: str) -> Callable[..., Any]:
    """The object at "package.module.name"."""
    module_path, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module_path), attr)


class SingletonMeta(type):
    """One instance per class (slime's GenerateState pattern)."""

    _instances: dict[type, Any] = {}

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls not in cls._instances:
            cls._instances[cls] = super().__call__(*args, **kwargs)
        return cls._instances[cls]

    def clear_instances(cls) -> None:
        cls._instances = {}
