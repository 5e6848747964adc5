"""The LoRA flags of slime's forks (slime itself has none), and Physarum's --lora-sync: each sets the job-spec key of
the same name."""

from __future__ import annotations

from typing import Any

from services.common.errors import InvalidArgument

# flag -> the type of its value; target-modules takes one or more names (or one comma-separated list)
LORA_FLAGS: dict[str, type] = {"lora-rank": int, "lora-alpha": float, "lora-dropout": float, "target-modules": list,
                               "lora-sync": str}


def lora_value(name: str, values: list[str]) -> Any:
    """`--name`'s value as the spec takes it; InvalidArgument naming the flag when it does not parse."""
    kind = LORA_FLAGS[name]
    if kind is list:
        modules = [m for v in values for m in v.split(",") if m]
        if not modules:
            raise InvalidArgument(f"--{name} expects at least one module name")
        return modules
    if len(values) != 1:
        raise InvalidArgument(f"--{name} expects one value, got {len(values)}")
    try:
        return kind(values[0])
    except ValueError:
        raise InvalidArgument(f"--{name}: invalid {kind.__name__} value: {values[0]!r}") from None
