"""Routing replay on megatron-core's MoE routers (its RouterReplay, `moe_enable_routing_replay`): record the experts
the old policy's forward routes each token to, or route a forward's tokens to given experts. megatron-core gathers
the router's scores at the replayed experts, so the gate weights stay the current router's.

A micro-batch's experts are [T, num_layers, top_k] in the order the routers see its tokens: a packed (THD) row's
tokens in order; a padded [b, L] batch sequence-first (position-major), as Megatron lays out activations. Under
sequence parallelism each TP rank's routers see one contiguous slice of that order, the row padded to a multiple of
the TP size (the pad tokens last in either layout): each replays its slice, and records are gathered over TP.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from services.trainer.batching.batch import RolloutBatch


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

    def __init__(self, gpt: torch.nn.Module, num_layers: int, top_k: int, *, sequence_parallel_group=None) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.num_layers, self.top_k = num_layers, top_k
        self.sp_group = sequence_parallel_group  # the TP group under sequence parallelism
        self.sp_size = dist.get_world_size(sequence_parallel_group) if sequence_parallel_group is not None else 1
        self.sp_rank = dist.get_rank(sequence_parallel_group) if sequence_parallel_group is not None else 0
        # the decoder's routers; an MTP layer's (layer_number past num_layers) routes as it would: neither the engines
        # nor the old policy's forward route its tokens
        self.replays = [(router.layer_number - 1, router.router_replay) for router in gpt.modules()
                        if isinstance(router, TopKRouter) and router.router_replay is not None
                        and router.layer_number <= num_layers]

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
            return lambda rows, mb: self.replaying(self._own_slice(flat_experts(mb, packed=packs(mb)),
                                                                   row_size=1 if packs(mb) else mb.size))

        @contextlib.contextmanager
        def recording(rows: Sequence[int], mb: RolloutBatch) -> Iterator[None]:
            with self.recording() as recorded:
                yield
            num_tokens = mb.size * mb.tokens.shape[1] if not packs(mb) else sum(mb.total_lengths)
            experts = self._gathered(recorded[0])[:num_tokens]  # without the pad tokens, which come last
            record[list(rows), :mb.tokens.shape[1]] = unflatten_experts(experts, mb, packed=packs(mb),
                                                                        empty=self.empty(*mb.tokens.shape))
        return recording

    def _own_slice(self, experts: torch.Tensor | None, *, row_size: int) -> torch.Tensor | None:
        """This TP rank's slice of a micro-batch's [T, ...] experts under sequence parallelism: the positions
        padded to a multiple of the TP size, row_size tokens each (a padded batch's b, a packed row's 1), the pad
        tokens routed to experts 0..k-1 (their outputs are unused)."""
        if experts is None or self.sp_size == 1:
            return experts
        extra = -(experts.shape[0] // row_size) % self.sp_size * row_size
        experts = torch.cat([experts, self.empty(extra).to(experts)]) if extra else experts
        size = experts.shape[0] // self.sp_size
        return experts[self.sp_rank * size:(self.sp_rank + 1) * size]

    def _gathered(self, experts: torch.Tensor) -> torch.Tensor:
        """The whole micro-batch's [T', ...] experts from each TP rank's recorded slice (sequence parallelism)."""
        if self.sp_size == 1:
            return experts
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else experts.device
        parts = [torch.empty_like(experts, device=device) for _ in range(self.sp_size)]
        dist.all_gather(parts, experts.to(device), group=self.sp_group)
        return torch.cat(parts).cpu()
