"""The trainer's side of delta weight sync: the served-precision copy of the version the engines hold (the base),
and the blob of what changed since it (`services.common.weight_delta`'s format). How a blob travels is the
push and pull broadcasters' job.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from services.common import weight_delta
from services.trainer.settings.weight_sync import DeltaSettings

log = logging.getLogger(__name__)

ENCODE_THREADS = min(4, os.cpu_count() or 1)  # numpy's xor and zstd release the GIL: tensors encode side by side


def served(named_tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None,
           spare: dict[str, torch.Tensor] | None = None) -> list[tuple[str, torch.Tensor]]:
    """Host copies of the tensors as the engines hold them: floating ones in the served dtype (None: as they are),
    written into `spare`'s tensor of the same name, shape and dtype where there is one (fresh memory costs page
    faults, which on some VMs cost more than the copy)."""
    spare = spare or {}
    out = []
    for name, tensor in named_tensors:
        tensor = tensor.detach()
        target = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        buffer = spare.get(name)
        if buffer is not None and buffer.shape == tensor.shape and buffer.dtype == target:
            out.append((name, buffer.copy_(tensor)))
        else:
            out.append((name, tensor.to(device="cpu", dtype=target, copy=True).contiguous()))
    return out


def bits(tensor: torch.Tensor) -> np.ndarray:
    """A host tensor's raw bits as a flat numpy array of unsigned integers of its element's width (shares memory)."""
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    return tensor.reshape(-1).view(width).numpy().view(weight_delta.bits_dtype(tensor.element_size()))


@dataclass
class DeltaStats:
    num_tensors: int = 0  # in the blob (changed)
    num_changed: int = 0  # elements
    num_elements: int = 0  # in the model
    full_bytes: int = 0  # the model in the served dtype
    bytes: int = 0  # of the blob

    @property
    def changed_fraction(self) -> float:
        return self.num_changed / self.num_elements if self.num_elements else 0.0

    def __add__(self, other: DeltaStats) -> DeltaStats:
        """Two parts of one delta together."""
        return DeltaStats(*(a + b for a, b in zip(vars(self).values(), vars(other).values(), strict=True)))


class DeltaTracker:
    """The base: the served-precision weights of the version every engine was last brought to, or none."""

    def __init__(self, settings: DeltaSettings | None = None) -> None:
        self.settings = settings or DeltaSettings()
        self.version: str | None = None
        self.base: dict[str, torch.Tensor] = {}
        self.spare: dict[str, torch.Tensor] = {}  # the base before the last commit: the next `stage`'s buffers
        self.scratch = threading.local()  # each encoding thread's xor buffer
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None

    def stage(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
              dtype: torch.dtype | None) -> list[tuple[str, torch.Tensor]]:
        """`served` copies of the tensors, in the buffers of the version before the base (kept for this)."""
        return served(named_tensors, dtype, self.spare)

    def reset(self) -> None:
        """Forget the base (after a failed sync: what the engines hold is unknown, so the next sync is full). Its
        buffers stay, to be staged into after the next commit."""
        self.version = None

    def commit(self, named: Sequence[tuple[str, torch.Tensor]], version: str) -> None:
        """The engines now hold `named` (host tensors in the served dtype, from `stage`) as `version`."""
        staged = dict(named)
        self.spare = {k: v for k, v in self.base.items() if k in staged and v is not staged[k]}
        self.version, self.base = str(version), staged

    def usable(self, named: Sequence[tuple[str, torch.Tensor]]) -> bool:
        """Whether a delta from the base can express `named`: same names, shapes and dtypes."""
        return len(named) == len(self.base) and self.covers(named)

    def covers(self, named: Sequence[tuple[str, torch.Tensor]]) -> bool:
        """Whether the base holds each of `named` (a whole model or a part of one) with its shape and dtype."""
        return self.version is not None and all(
            name in self.base and self.base[name].shape == t.shape and self.base[name].dtype == t.dtype
            for name, t in named)

    def encode(self, named: Sequence[tuple[str, torch.Tensor]], version: str) -> tuple[bytearray, DeltaStats]:
        """The blob taking the base's `named` tensors (the whole model, or a part of it) to theirs as `version` (the
        base is kept until `commit`)."""
        if not self.covers(named):
            raise ValueError("no delta base for these tensors: send them in full first")
        weight_delta.check_version(version)
        algo, encoding = self.settings.checksum, self.settings.encoding
        largest = max((t.numel() for _, t in named), default=0)

        def one(item: tuple[str, torch.Tensor]) -> tuple[weight_delta.Entry, bytes | memoryview] | None:
            name, tensor = item
            new = bits(tensor)
            scratch = getattr(self.scratch, "buffer", None)
            if scratch is None or scratch.dtype != new.dtype or scratch.size < new.size:
                scratch = self.scratch.buffer = np.empty(max(new.size, largest), dtype=new.dtype)
            encoded = weight_delta.encode(bits(self.base[name]), new, encoding, scratch)
            if encoded is None:
                return None
            payload, num_changed, compressed = encoded
            entry = weight_delta.Entry(name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), encoding,
                                       compressed, num_changed, weight_delta.checksum(new, algo))
            return entry, payload

        if self.pool is None:  # kept: each thread keeps its scratch buffer from one sync to the next
            self.pool = concurrent.futures.ThreadPoolExecutor(ENCODE_THREADS, thread_name_prefix="delta-encode")
        items = [item for item in self.pool.map(one, named) if item is not None]
        blob, entries = weight_delta.pack(self.version, version, algo, items)
        stats = DeltaStats(num_tensors=len(entries), num_changed=sum(e.num_changed for e in entries),
                           num_elements=sum(t.numel() for _, t in named),
                           full_bytes=sum(t.numel() * t.element_size() for _, t in named), bytes=len(blob))
        log.info("delta %s -> %s: %d of %d tensors changed, %.3f%% of elements, %.2f MB of %.1f MB", self.version,
                 version, stats.num_tensors, len(named), 100 * stats.changed_fraction, stats.bytes / 1e6,
                 stats.full_bytes / 1e6)
        return blob, stats
