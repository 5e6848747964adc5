"""Read and write HF checkpoint directories without building an HF model: safetensors (one file or an index).

Reading is lazy, so each rank loads only the tensors of its own pipeline stage.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from services.common.errors import InvalidArgument
from services.trainer.checkpoint.hf_files import copy_side_files

# Copied next to the weights, so the directory is a complete model for transformers and the engines.


def read_config(path: Path) -> dict:
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise InvalidArgument(f"model {path}: cannot read config.json ({err})") from err


class HFTensors(Mapping[str, torch.Tensor]):
    """name -> tensor of an HF safetensors checkpoint, each read from disk when asked for."""

    def __init__(self, path: Path) -> None:
        index = path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._files = {name: path / file for name, file in weight_map.items()}
        elif (path / "model.safetensors").is_file():
            from safetensors import safe_open

            with safe_open(path / "model.safetensors", framework="pt") as f:
                self._files = dict.fromkeys(f.keys(), path / "model.safetensors")
        else:
            raise InvalidArgument(f"model {path}: no model.safetensors or model.safetensors.index.json")
        self.path = path

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if name not in self._files:
            raise InvalidArgument(f"model {self.path}: checkpoint has no tensor {name!r}")
        with safe_open(self._files[name], framework="pt") as f:
            return f.get_tensor(name).float()

    def __contains__(self, name: object) -> bool:
        return name in self._files

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)


def write_checkpoint(path: Path, tensors: dict[str, torch.Tensor], source: Path) -> None:
    """model.safetensors from `tensors` plus config, generation config and tokenizer files copied from `source`."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file({name: t.detach().cpu().contiguous() for name, t in tensors.items()}, path / "model.safetensors",
              metadata={"format": "pt"})
    copy_side_files(source, path)
