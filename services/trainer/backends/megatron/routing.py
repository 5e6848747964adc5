"""Routing replay on megatron-core's MoE routers (its RouterReplay, `moe_enable_routing_replay`): record the experts
the old policy's forward routes each token to, or route a forward's tokens to given experts. megatron-core gathers
the router's scores at the replayed experts, so the gate weights stay the current router's.

A micro-batch's experts are [T, num_layers, top_k] in the order the routers see its tokens: a packed (THD) row's
tokens in order; a padded [b, L] batch sequence-first (position-major), as Megatron lays out activations.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch

from services.trainer.backends.batch import RolloutBatch


def flat_experts(mb: RolloutBatch, *, packed: bool) -> torch.Tensor | None:
    """The micro-batch's routed experts [T, num_layers, top_k] in the routers' token order."""
    if mb.routed_experts is None:
        return None
    if packed:
        return mb.flat_routed_experts(packed=True)
    return mb.routed_experts.transpose(0, 1).flatten(0, 1)


def unflatten_experts(experts: torch.Tensor, mb: RolloutBatch, *, packed: bool, empty: torch.Tensor) -> torch.Tensor:
    """[b, L, num_layers, top_k] of the micro-batch from its routers' [T, num_layers, top_k] (`empty`: the
    [b, L, num_layers, top_k] to fill, for the padding a packed row leaves out)."""
    if packed:
        empty[mb.attention_mask.bool().cpu()] = experts
        return empty
    return experts.view(mb.tokens.shape[1], mb.tokens.shape[0], *experts.shape[1:]).transpose(0, 1)


class MegatronRouting:
    """The policy's RouterReplay instances, by decoder layer (this pipeline stage's MoE layers)."""

    def __init__(self, gpt: torch.nn.Module, num_layers: int, top_k: int) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.num_layers, self.top_k = num_layers, top_k
        self.replays = [(router.layer_number - 1, router.router_replay) for router in gpt.modules()
                        if isinstance(router, TopKRouter) and router.router_replay is not None]

    def empty(self, *shape: int) -> torch.Tensor:
        """[*shape, num_layers, top_k] experts 0..k-1: what unrecorded tokens replay (their outputs are unused)."""
        row = torch.arange(self.top_k, dtype=torch.int32)
        return row.expand(*shape, self.num_layers, self.top_k).clone()

    @contextlib.contextmanager
    def replaying(self, experts: torch.Tensor | None) -> Iterator[None]:
        """The forward in the block routes its T tokens to experts [T, num_layers, top_k] (None: as it would)."""
        if experts is None:
            yield
            return
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        for layer, replay in self.replays:
            replay.set_target_indices(experts[:, layer].to(torch.long))
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        try:
            yield
        finally:
            for _, replay in self.replays:
                replay.clear_router_replay_action()
                replay.clear_indices()

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[torch.Tensor]]:
        """Record the forward in the block: the yielded list then holds its [T, num_layers, top_k] on the host."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        out: list[torch.Tensor] = []
        for _, replay in self.replays:
            replay.set_router_replay_action(RouterReplayAction.RECORD)
        try:
            yield out
            recorded = [(layer, replay.get_recorded_indices()) for layer, replay in self.replays]
        finally:
            for _, replay in self.replays:
                replay.clear_router_replay_action()
                replay.clear_indices()
        experts = self.empty(recorded[0][1].shape[0]) if recorded else self.empty(0)
        for layer, indices in recorded:
            experts[:, layer] = indices.to(device="cpu", dtype=torch.int32)
        out.append(experts)

    def around(self, *, packs: Callable[[RolloutBatch], bool], record: torch.Tensor | None = None) -> Callable:
        """A context for each micro-batch's forward, by (rows, micro-batch): route to the micro-batch's experts, or
        (`record` [B, L, num_layers, top_k]) record the experts of its rows into `record`. `packs(mb)`: whether the
        backend runs that micro-batch packed."""
        if record is None:
            return lambda rows, mb: self.replaying(flat_experts(mb, packed=packs(mb)))

        @contextlib.contextmanager
        def recording(rows: Sequence[int], mb: RolloutBatch) -> Iterator[None]:
            with self.recording() as recorded:
                yield
            record[list(rows), :mb.tokens.shape[1]] = unflatten_experts(recorded[0], mb, packed=packs(mb),
                                                                        empty=self.empty(*mb.tokens.shape))
        return recording
