"""Routing replay on transformers' MoE layers (slime's --use-routing-replay, --use-rollout-routing-replay): record the
experts each router picks, or route every token to recorded experts, so that a training forward sends each token
through the experts of the forward it is compared with (the old policy's, or the engine's).

Replaying replaces only the router's top-k indices: the gate weights are the current router's probabilities at the
recorded experts (renormalized as the router does), so the router still learns. A forward's experts are int32
[T, num_layers, top_k] over its T input tokens in order (SGLang's routed_experts layout; a dense layer's entries are
unused). Routers are transformers' top-k routers of the families in models/families.py's REPLAYABLE_ROUTERS, which
return (logits, top-k weights, top-k indices).
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable, Iterator, Sequence

import torch

from services.common.errors import InvalidArgument
from services.trainer.batching.batch import RolloutBatch
from services.trainer.models.families import REPLAYABLE_ROUTERS

_ROUTER_CLASSES = frozenset(REPLAYABLE_ROUTERS.values())
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def moe_routers(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """(decoder layer index, router) of every softmax top-k router in `model`, in layer order."""
    routers = []
    for name, module in model.named_modules():
        if type(module).__name__ in _ROUTER_CLASSES and (match := _LAYER.search(name)):
            routers.append((int(match.group(1)), module))
    return sorted(routers, key=lambda item: item[0])


def replayed_gate(logits: torch.Tensor, experts: torch.Tensor, *, normalize: bool, sigmoid: bool = False,
                  scaling_factor: float = 1.0) -> torch.Tensor:
    """[T, k] gate weights at the given experts [T, k] from router logits [T, E], as the router computes its own:
    softmax (Qwen) or sigmoid (GLM-4-MoE, DeepSeek-V3: the expert bias only chooses, it does not weigh) probabilities
    in float32, renormalized over the k when the router does, times its scaling factor, in the logits' dtype."""
    if sigmoid:
        weights = torch.sigmoid(logits.float()).gather(1, experts)
        if normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        weights = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(1, experts)
        if normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights * scaling_factor).to(logits.dtype)


class RoutingReplay:
    """Forward hooks on a model's routers; `recording()` and `replaying(experts)` set what a forward does with them,
    and outside both the routers route as they are."""

    def __init__(self, model: torch.nn.Module, num_layers: int) -> None:
        self.routers = moe_routers(model)
        if not self.routers:
            raise InvalidArgument(f"routing replay: {type(model).__name__} has no MoE router it replays (families: "
                                  f"{', '.join(REPLAYABLE_ROUTERS)})")
        self.num_layers = num_layers
        self.top_k = int(self.routers[0][1].top_k)
        self._replay: torch.Tensor | None = None
        self._recorded: dict[int, torch.Tensor] | None = None
        for layer, router in self.routers:
            router.register_forward_hook(functools.partial(self._hook, layer))

    def _hook(self, layer: int, router: torch.nn.Module, inputs, output):
        logits, _weights, indices = output
        if self._recorded is not None:
            self._recorded[layer] = indices.detach()
            return None
        if self._replay is None:
            return None
        experts = self._replay[:, layer].to(device=logits.device, dtype=torch.long)
        if experts.shape != indices.shape:
            raise ValueError(f"routing replay: layer {layer} routes {tuple(indices.shape)} tokens × top-k, the "
                             f"recorded experts are {tuple(experts.shape)}")
        sigmoid = hasattr(router, "e_score_correction_bias")  # GLM-4-MoE's and DeepSeek-V3's routers
        gate = replayed_gate(logits, experts, normalize=getattr(router, "norm_topk_prob", True), sigmoid=sigmoid,
                             scaling_factor=getattr(router, "routed_scaling_factor", 1.0) if sigmoid else 1.0)
        return logits, gate, experts.to(indices.dtype)

    def empty(self, num_tokens: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """[num_tokens, num_layers, top_k] experts 0..k-1 on every token: what padding and unrecorded tokens (a
        sequence's last, which no forward the engine ran was fed) replay; their outputs are never used."""
        row = torch.arange(self.top_k, dtype=torch.int32, device=device)
        return row.expand(num_tokens, self.num_layers, self.top_k).clone()

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[torch.Tensor]]:
        """Record one forward's routing: the yielded list holds its [T, num_layers, top_k] once the block ends."""
        self._recorded, out = {}, []
        try:
            yield out
            recorded = self._recorded
        finally:
            self._recorded = None
        num_tokens = next(iter(recorded.values())).shape[0] if recorded else 0
        experts = self.empty(num_tokens)
        for layer, indices in recorded.items():
            experts[:, layer] = indices.to(device="cpu", dtype=torch.int32)
        out.append(experts)

    @contextlib.contextmanager
    def replaying(self, experts: torch.Tensor | None) -> Iterator[None]:
        """Forwards in the block route their T tokens to experts [T, num_layers, top_k] (None: as they are)."""
        if experts is not None and tuple(experts.shape[1:]) != (self.num_layers, self.top_k):
            raise ValueError(f"routing replay: experts of shape {tuple(experts.shape)}, the model has "
                             f"{self.num_layers} layers and top-k {self.top_k}")
        self._replay = experts
        try:
            yield
        finally:
            self._replay = None

    @torch.no_grad()
    def record_batch(self, forward: Callable[[RolloutBatch], torch.Tensor], batch: RolloutBatch,
                     micro_batches: Sequence[Sequence[int]], *,
                     packs: Callable[[RolloutBatch], bool]) -> tuple[torch.Tensor, RolloutBatch]:
        """Run `forward(mb) -> [b, R]` (the old policy's log-probs) over the micro-batches, recording: its [B, R]
        outputs, and the batch with the experts that forward routed each token to, to replay. `packs(mb)`: whether
        the backend runs that micro-batch packed."""
        outputs = torch.zeros_like(batch.loss_masks)
        experts = self.empty(batch.tokens.numel()).view(*batch.tokens.shape, self.num_layers, self.top_k)
        for rows in micro_batches:
            mb = batch.take(rows or [0])  # an empty micro-batch still runs: the ranks' collectives stay in step
            with self.recording() as recorded:
                values = forward(mb)
            if not rows:
                continue
            outputs[rows, :values.shape[1]] = values
            shape = (*mb.tokens.shape, self.num_layers, self.top_k)
            if packs(mb):
                mb_experts = self.empty(mb.tokens.numel()).view(shape)
                mb_experts[mb.attention_mask.bool().cpu()] = recorded[0]
            else:
                mb_experts = recorded[0].view(shape)
            experts[rows, :mb.tokens.shape[1]] = mb_experts
        return outputs, batch.with_routed_experts(experts)
