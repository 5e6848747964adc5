"""The vision tower on a rank whose micro-batch has no images, under FSDP2 over several ranks: each backward
reduce-scatters the gradients its rank computed, so a rank that left the tower out while another ran it would send
fewer (a collective mismatch). Such a rank runs the tower on one blank merged patch inside the model's forward and
adds its outputs times 0: its backward holds the tower's gradients too, all zero."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class IdleVision:
    """Hooks `model`'s inner model (a ...ForConditionalGeneration's `model`, which owns `visual`); within
    `running()`, its forward also runs the tower on a blank patch, weighted 0."""

    def __init__(self, model: torch.nn.Module) -> None:
        inner = model.model
        self.visual = inner.visual
        config = self.visual.config
        merge = config.spatial_merge_size
        width = config.in_channels * config.temporal_patch_size * config.patch_size ** 2
        self.pixels = torch.zeros(merge * merge, width)
        self.grid = torch.tensor([[1, merge, merge]])
        self.active = False
        inner.register_forward_hook(self._add_zero_weighted)

    @contextlib.contextmanager
    def running(self, active: bool = True) -> Iterator[None]:
        self.active = active
        try:
            yield
        finally:
            self.active = False

    def _add_zero_weighted(self, _module, _args, output):
        if not self.active:
            return output
        hidden = output.last_hidden_state
        out = self.visual(self.pixels.to(hidden.device, self.visual.dtype), grid_thw=self.grid.to(hidden.device))
        features = [out.pooler_output, *(getattr(out, "deepstack_features", None) or [])]
        output.last_hidden_state = hidden + sum(f.sum() for f in features).to(hidden.dtype) * 0.0
        return output
