"""LoRA layers: each targeted nn.Linear becomes y = W x + b + (alpha / r) · B(A(dropout(x))), with W and b frozen,
A kaiming-initialized and B zero (so a fresh adapter changes nothing). The reference model of KL is the same model
with the adapters switched off (`adapters_disabled`), not a second copy. Several jobs' adapters can take turns on one
base model: each job keeps its own A and B (`Adapter`), put into the layers for its turn (`install`)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from services.common.errors import InvalidArgument

# The KL reference of a LoRA policy, as the backend passes it where a reference model goes: the policy itself with
# the adapters off (`adapters_disabled`).
BASE_MODEL = nn.Identity()


class LoRALinear(nn.Module):
    """A Linear with a low-rank adapter. It holds the wrapped Linear's own `weight` and `bias` parameters, so the
    base weights keep their HF names (`<module>.weight`); the adapter is `<module>.lora_A.weight` [r, in] and
    `<module>.lora_B.weight` [out, r], PEFT's names."""

    def __init__(self, linear: nn.Linear, *, rank: int, alpha: float, dropout: float) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.adapter_enabled = True
        self.new_adapter(rank=rank, alpha=alpha, dropout=dropout)

    def new_adapter(self, *, rank: int, alpha: float, dropout: float) -> None:
        """A fresh adapter in this layer (the one it held stays with whoever kept it: `Adapter`)."""
        self.rank, self.alpha, self.dropout = rank, alpha, dropout
        self.scaling = alpha / rank
        device = self.weight.device
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, device=device, dtype=torch.float32)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, device=device, dtype=torch.float32)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # PEFT's and nn.Linear's init
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if not self.adapter_enabled:
            return out
        # dropout in the training forward (with grad) only: the backend keeps its model in eval mode, and the
        # no-grad recomputes (old and reference log-probs) see the adapter whole, as the engines do
        x = F.dropout(x, self.dropout, training=torch.is_grad_enabled()) if self.dropout > 0 else x
        return out + self.lora_B(self.lora_A(x)) * self.scaling

    def delta_weight(self) -> torch.Tensor:
        """scaling · B @ A [out, in]: what merging adds to W."""
        return (self.lora_B.weight @ self.lora_A.weight) * self.scaling

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}, " \
               f"alpha={self.alpha}"


def add_adapters(model: nn.Module, *, rank: int, alpha: float, dropout: float,
                 target_modules: Sequence[str]) -> list[str]:
    """Freeze every parameter of `model`, then wrap each nn.Linear whose name ends in one of `target_modules`
    (PEFT's rule: the last component, or a dotted suffix) with a LoRALinear whose A and B alone train; a layer
    already wrapped (a base model another job's adapter is on) gets a fresh adapter of its own. Returns the wrapped
    modules' names; InvalidArgument when a target matches no Linear (a typo would train nothing)."""
    held = {id(p) for _, layer in lora_layers(model) for p in (layer.lora_A.weight, layer.lora_B.weight)}
    for parameter in model.parameters():  # the base; an adapter another job trains on it stays trainable
        if id(parameter) not in held:
            parameter.requires_grad_(False)
    targets = list(target_modules)
    found: dict[str, str] = {}
    for name, module in list(model.named_modules()):
        if not isinstance(module, (nn.Linear, LoRALinear)) or name.split(".")[-1] in ("lora_A", "lora_B"):
            continue
        target = next((t for t in targets if name == t or name.endswith("." + t)), None)
        if target is None or name.split(".")[-1] == "lm_head":
            continue
        if isinstance(module, LoRALinear):
            module.new_adapter(rank=rank, alpha=alpha, dropout=dropout)
        else:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, LoRALinear(module, rank=rank, alpha=alpha, dropout=dropout))
        found[name] = target
    if missing := [t for t in targets if t not in found.values()]:
        raise InvalidArgument(f"target_modules: {', '.join(missing)} match no Linear layer of "
                              f"{type(model).__name__} (the lm_head is never adapted)")
    return sorted(found)


def lora_layers(model: nn.Module) -> Iterator[tuple[str, LoRALinear]]:
    """(name, layer) of every LoRALinear in `model`."""
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            yield name, module


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model: every adapter of `model` off inside the block (the KL reference's forward)."""
    layers = [layer for _, layer in lora_layers(model)]
    previous = [layer.adapter_enabled for layer in layers]
    for layer in layers:
        layer.adapter_enabled = False
    try:
        yield
    finally:
        for layer, enabled in zip(layers, previous, strict=True):
            layer.adapter_enabled = enabled


@dataclass(frozen=True)
class Adapter:
    """One job's adapter on a base model: each LoRALinear's A and B modules (the parameters its optimizer holds),
    with their rank, alpha and dropout, by the layer's name."""

    layers: dict[str, tuple[nn.Linear, nn.Linear, int, float, float]]


def adapter_of(model: nn.Module) -> Adapter:
    """The adapter the LoRALinear layers of `model` hold now."""
    return Adapter({name: (layer.lora_A, layer.lora_B, layer.rank, layer.alpha, layer.dropout)
                    for name, layer in lora_layers(model)})


def install(model: nn.Module, adapter: Adapter) -> None:
    """Put `adapter` into the LoRALinear layers of `model` (each layer it names: those are all of them when the
    adapter was taken from this model with the same target_modules)."""
    for name, layer in lora_layers(model):
        lora_a, lora_b, rank, alpha, dropout = adapter.layers[name]
        layer.lora_A, layer.lora_B = lora_a, lora_b
        layer.rank, layer.alpha, layer.dropout, layer.scaling = rank, alpha, dropout, alpha / rank
