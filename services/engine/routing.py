"""The experts an MoE model's routers pick for each token the engine feeds it (SGLang's return_routed_experts): forward
hooks on transformers' top-k routers record one model call's top-k indices as [rows, num_layers, top_k].

Knows nothing of requests: generation.py hands each request its rows, protocol.py encodes them as SGLang does.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Iterator

import torch

# the routers whose (logits, weights, top-k indices) output is recorded: the families the trainer replays
ROUTER_CLASSES = frozenset({"Qwen3MoeTopKRouter", "Qwen3_5MoeTopKRouter", "Glm4MoeTopkRouter", "DeepseekV3TopkRouter"})
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class RoutedExperts:
    """Hooks on the model's routers; `capture()` records the model calls made inside it."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.num_layers = int(model.config.get_text_config().num_hidden_layers)
        self.top_k = 0
        self._calls: dict[int, torch.Tensor] | None = None
        for name, module in model.named_modules():
            if type(module).__name__ in ROUTER_CLASSES and (match := _LAYER.search(name)):
                self.top_k = int(module.top_k)
                module.register_forward_hook(functools.partial(self._hook, int(match.group(1))))

    @property
    def available(self) -> bool:
        return self.top_k > 0

    def _hook(self, layer: int, module, inputs, output) -> None:
        if self._calls is not None:
            self._calls[layer] = output[2].detach()

    @contextlib.contextmanager
    def capture(self, enabled: bool = True) -> Iterator[list[torch.Tensor]]:
        """Record the one model call made in the block: the yielded list then holds int32 [rows, num_layers, top_k]
        on the host over the call's flattened (batch, position) rows; a dense layer's entries are 0."""
        out: list[torch.Tensor] = []
        if not enabled:
            yield out
            return
        self._calls = {}
        try:
            yield out
            calls = self._calls
        finally:
            self._calls = None
        rows = next(iter(calls.values())).shape[0] if calls else 0
        experts = torch.zeros((rows, self.num_layers, self.top_k), dtype=torch.int32)
        for layer, indices in calls.items():
            experts[:, layer] = indices.to(device="cpu", dtype=torch.int32)
        out.append(experts)
