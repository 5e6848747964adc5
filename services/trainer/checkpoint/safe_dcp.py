"""A torch.distributed.checkpoint reader whose metadata cannot run code: a checkpoint is a file a job spec names.

DCP's own reader unpickles `.metadata` with `pickle.load`, so a crafted checkpoint would run its pickle in the
trainer. This reader resolves only the classes DCP's metadata is made of (and refuses any other global); tensors
and saved values are already read with `torch.load(weights_only=True)` by DCP itself.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from services.common.errors import InvalidArgument

# megatron-core's torch_dist writer also keeps its save plans (planner dataclasses and enums) in the metadata
_ALLOWED_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                    "torch.distributed.checkpoint.planner")
_ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
            ("pathlib", "PurePosixPath"), ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        import torch

        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if not (module in _ALLOWED_MODULES and not name.startswith("__")) and (module, name) not in _ALLOWED \
                and not dtype:
            raise pickle.UnpicklingError(f"global {module}.{name} is not part of checkpoint metadata")
        return super().find_class(module, name)


def load_metadata(data: bytes, where: str) -> Metadata:
    """DCP metadata from its pickled bytes; InvalidArgument naming `where` if it holds anything else."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError, ValueError) as err:
        raise InvalidArgument(f"checkpoint {where}: unsafe or unreadable metadata ({err})") from None
    if not isinstance(metadata, Metadata):
        raise InvalidArgument(f"checkpoint {where}: metadata is a {type(metadata).__name__}, not DCP Metadata")
    return metadata


class SafeFileSystemReader(dcp.FileSystemReader):
    """FileSystemReader with `load_metadata` in place of pickle.load."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = load_metadata(stream.read(), str(Path(self.path)))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
