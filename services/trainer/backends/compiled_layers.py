"""Regional torch.compile, for both backends: each decoder layer's forward compiled (HF's layers under fsdp,
megatron-core's TransformerLayers under megatron), one compiled graph shared by every layer (the layers run the same
code on parameters dynamo treats as inputs), with dynamic shapes so that the row lengths a job sees do not each
compile again. Lowers Python overhead between small kernels and fuses the layers' pointwise work.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

# a compile per grad mode (training forwards, no-grad recomputes) and layout (packed rows, padded rectangles) at
# most, with a margin; past it dynamo runs the layer eagerly rather than compile again
RECOMPILE_LIMIT = 8


def compile_layers(layers: list[torch.nn.Module]) -> int:
    """Compile each of `layers` in place (nn.Module.compile, dynamic shapes). Returns how many it compiled."""
    if not layers:
        return 0
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, RECOMPILE_LIMIT)
    for layer in layers:
        layer.compile(dynamic=True)
    log.info("compiled %d %s layers (one graph shared, dynamic shapes)", len(layers), type(layers[0]).__name__)
    return len(layers)


def compiles_so_far() -> int:
    """Graphs dynamo has compiled in this process (its counters): what the recompile bound is checked against."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
