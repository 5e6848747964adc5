"""A vision-language checkpoint's weight names (Qwen2.5-VL, Qwen3-VL): its language model's tensors under the
language model's own names, whether its files hold transformers' in-memory names (model.language_model.*,
model.visual.*) or the released checkpoints' (model.*, visual.*); and back to the in-memory names the engines load.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

LANGUAGE_MODEL = "model.language_model."  # in memory; on disk often model.*
VISUAL = "model.visual."  # in memory; on disk often visual.*
TOWER = "visual."  # the vision tower's parameters inside the megatron model


class CheckpointNames(Mapping):
    """`tensors` (a vision-language checkpoint's) read by language-model names (model.layers.0..., lm_head.weight)
    and by the tower's own (visual.<name>)."""

    def __init__(self, tensors: Mapping) -> None:
        self.tensors = tensors

    def _candidates(self, name: str) -> tuple[str, ...]:
        if name.startswith(TOWER):
            return VISUAL + name.removeprefix(TOWER), name
        if name.startswith("model."):
            return LANGUAGE_MODEL + name.removeprefix("model."), name
        return (name,)

    def _find(self, name: str) -> str | None:
        return next((candidate for candidate in self._candidates(name) if candidate in self.tensors), None)

    def __getitem__(self, name: str):
        found = self._find(name)
        return self.tensors[found if found is not None else name]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._find(name) is not None

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def tower_names(self) -> list[str]:
        """The vision tower's tensors, by their names inside the tower (visual.<name>)."""
        return [TOWER + name.removeprefix(VISUAL) if name.startswith(VISUAL) else name
                for name in self.tensors if name.startswith((VISUAL, TOWER))]


def in_memory_name(name: str) -> str:
    """The transformers in-memory name of a language-model (model.*) or tower (visual.*) weight name."""
    if name.startswith(TOWER):
        return VISUAL + name.removeprefix(TOWER)
    if name.startswith("model."):
        return LANGUAGE_MODEL + name.removeprefix("model.")
    return name
