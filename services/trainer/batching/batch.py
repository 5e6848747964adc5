"""Samples -> padded tensors: the RolloutBatch a backend trains on (slime's train-data keys; a micro-batch is packed
into one row only at its forward, `packing.py`).

Response-aligned tensors are [B, R]: column t is response token t of each sample, whose log-prob comes from the
logits at sequence position prompt_length + t - 1. The batch knows nothing about models or losses; the trainer fills
in the per-token tensors it computes (old / reference log-probs, critic values, advantages, returns) with `with_`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch

from services.common.errors import InvalidArgument
from services.common.samples import Sample

HOST = torch.device("cpu")  # where samples are padded (one copy per tensor to the rank's device afterwards)
# The [B, R] fields that the trainer computes after building the batch (slime's rollout_data keys).
COMPUTED = ("log_probs", "ref_log_probs", "values", "advantages", "returns", "teacher_log_probs")
SEQUENCE_ALIGNED = ("tokens", "attention_mask", "routed_experts")  # [B, L, ...]; the others [B] or [B, R]


@dataclass(frozen=True)
class RolloutBatch:
    tokens: torch.Tensor  # [B, L] int64, prompt + response, right-padded with the pad id
    attention_mask: torch.Tensor  # [B, L] int64, 1 on real tokens
    prompt_lengths: torch.Tensor  # [B] int64
    response_lengths: torch.Tensor  # [B] int64
    response_tokens: torch.Tensor  # [B, R] int64, the targets; padded with the pad id
    loss_masks: torch.Tensor  # [B, R] float32, 0 on padding and on masked (e.g. tool) tokens
    rollout_log_probs: torch.Tensor | None  # [B, R] float32, the engines' log-probs; None unless every sample has them
    advantages: torch.Tensor  # [B, R] float32, zeros until the trainer sets them
    rewards: torch.Tensor  # [B] float32, the raw scalar rewards
    log_probs: torch.Tensor | None = None  # [B, R] the old policy's log-probs (recomputed), when computed
    ref_log_probs: torch.Tensor | None = None  # [B, R] the reference model's log-probs, when computed
    values: torch.Tensor | None = None  # [B, R] the critic's values (ppo)
    returns: torch.Tensor | None = None  # [B, R] the estimator's returns (ppo: the critic's targets)
    # [B, L, num_layers, top_k] int32: the experts each token is routed to when replayed (moe/hf_routing_replay.py)
    routed_experts: torch.Tensor | None = None
    # [B, R] on-policy distillation's teacher log-probs of the response tokens: the samples' own (a teacher engine
    # gave them) or a teacher model's in the trainer
    teacher_log_probs: torch.Tensor | None = None
    # [B] int64: each row's position among the rollout's samples, set when any has images (vision.py finds a row's
    # images by it); None for a text rollout
    sample_index: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    @property
    def total_lengths(self) -> list[int]:
        """Tokens of each sample (prompt + response): what dynamic batching packs by."""
        return (self.prompt_lengths + self.response_lengths).tolist()

    def logit_positions(self) -> torch.Tensor:
        """[B, R] int64: the sequence position whose logits predict each response token (clamped on padding)."""
        offsets = torch.arange(self.response_tokens.shape[1], dtype=torch.long, device=self.prompt_lengths.device)
        positions = self.prompt_lengths.unsqueeze(-1) - 1 + offsets
        return positions.clamp(0, self.tokens.shape[1] - 1)

    def take(self, rows: Sequence[int]) -> RolloutBatch:
        """The given rows, in order, with padding trimmed to the longest of them."""
        index = torch.as_tensor(list(rows), dtype=torch.long, device=self.tokens.device)
        seq_len = int((self.prompt_lengths[index] + self.response_lengths[index]).max())
        resp_len = int(self.response_lengths[index].max())
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                out[f.name] = None
            elif value.dim() == 1:
                out[f.name] = value[index]
            else:
                out[f.name] = value[index, :seq_len if f.name in SEQUENCE_ALIGNED else resp_len]
        return RolloutBatch(**out)

    def select(self, start: int, end: int) -> RolloutBatch:
        """Rows [start, end), with padding trimmed to the longest of them."""
        return self.take(range(start, end))

    def with_(self, **tensors: torch.Tensor | None) -> RolloutBatch:
        """A copy with response-aligned [B, R] tensors set (advantages, returns, log_probs, ...)."""
        for name, value in tensors.items():
            if name not in COMPUTED:
                raise ValueError(f"with_: {name!r} is not one of {', '.join(COMPUTED)}")
            if value is not None and value.shape != self.loss_masks.shape:
                raise ValueError(f"{name} shape {tuple(value.shape)} != loss_masks {tuple(self.loss_masks.shape)}")
        return replace(self, **{k: None if v is None else v.float() for k, v in tensors.items()})

    def with_routed_experts(self, routed_experts: torch.Tensor) -> RolloutBatch:
        """A copy that replays routed_experts [B, L, num_layers, top_k] (recorded by the trainer's own forward)."""
        if tuple(routed_experts.shape[:2]) != tuple(self.tokens.shape):
            raise ValueError(f"routed_experts shape {tuple(routed_experts.shape)} != tokens {tuple(self.tokens.shape)}")
        return replace(self, routed_experts=routed_experts.to(device=self.device, dtype=torch.int32))

    def flat_routed_experts(self, *, packed: bool) -> torch.Tensor | None:
        """[T, num_layers, top_k]: the experts of the forward's input tokens in order, packed (real tokens, back to
        back) or padded (every position of the rectangle)."""
        if self.routed_experts is None:
            return None
        return self.routed_experts[self.attention_mask.bool()] if packed else self.routed_experts.flatten(0, 1)

    def with_advantages(self, advantages: torch.Tensor) -> RolloutBatch:
        return self.with_(advantages=advantages)

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    def to(self, device: torch.device | str) -> RolloutBatch:
        """Every tensor on `device` (a no-op for those already there)."""
        device = torch.device(device)
        return replace(self, **{f.name: value.to(device) for f in fields(self)
                                if (value := getattr(self, f.name)) is not None and value.device != device})


def _check_sample(i: int, sample: Sample) -> None:
    total, resp = len(sample.tokens), sample.response_length
    if resp < 0 or resp >= total:
        raise InvalidArgument(f"sample {i}: response_length {resp} must be in [0, len(tokens) - 1] = [0, {total - 1}]"
                              " (a response token needs at least one token before it)")
    if sample.loss_mask and len(sample.loss_mask) != resp:
        raise InvalidArgument(f"sample {i}: loss_mask has {len(sample.loss_mask)} entries, "
                              f"response_length is {resp}")
    for name in ("rollout_log_probs", "teacher_log_probs"):
        if getattr(sample, name) and len(getattr(sample, name)) != resp:
            raise InvalidArgument(f"sample {i}: {name} has {len(getattr(sample, name))} entries, "
                                  f"response_length is {resp}")


def _routed_experts(samples: Sequence[Sample], seq_len: int, shape: tuple[int, int]) -> torch.Tensor | None:
    """[B, L, num_layers, top_k] int32 from the samples' engine-routed experts (rows len(tokens) - 1 each), experts
    0..k-1 where none was routed (a sequence's last token, padding)."""
    if missing := [i for i, s in enumerate(samples) if not s.rollout_routed_experts]:
        raise InvalidArgument(f"use_rollout_routing_replay: sample {missing[0]} came without the engines' routed "
                              "experts (rollout_routed_experts); the engines must honour return_routed_experts")
    num_layers, top_k = shape
    out = torch.arange(top_k, dtype=torch.int32, device=HOST).expand(len(samples), seq_len, num_layers, top_k).clone()
    for i, s in enumerate(samples):
        rows = len(s.tokens) - 1
        if len(s.rollout_routed_experts) != rows * num_layers * top_k:
            raise InvalidArgument(f"sample {i}: rollout_routed_experts has {len(s.rollout_routed_experts)} entries, "
                                  f"not (len(tokens) - 1) × layers × top-k = {rows} × {num_layers} × {top_k}")
        out[i, :rows] = torch.tensor(s.rollout_routed_experts, dtype=torch.int32, device=HOST).view(
            rows, num_layers, top_k)
    return out


def sample_reward(sample: Sample, reward_key: str = "") -> float:
    """The scalar a sample trains on: reward_scores[reward_key] when the reward function returned a dict holding
    that key (slime's --reward-key), else `reward` (which the rollout manager already picked the same way)."""
    if reward_key and reward_key in sample.reward_scores:
        return float(sample.reward_scores[reward_key])
    return float(sample.reward)


def build_rollout_batch(samples: Sequence[Sample], *, pad_token_id: int = 0, reward_key: str = "",
                        device: torch.device | str = HOST,
                        routing_shape: tuple[int, int] | None = None) -> RolloutBatch:
    """Pad `samples` into a RolloutBatch on `device`; a sample without a loss_mask trains on all its response
    tokens. With routing_shape (num_layers, top_k) the samples' engine-routed experts come along (each sample must
    have them). The padding is done on the host, then moved in one copy per tensor."""
    if not samples:
        raise InvalidArgument("rollout has no samples")
    for i, sample in enumerate(samples):
        _check_sample(i, sample)
    num, seq_len = len(samples), max(len(s.tokens) for s in samples)
    resp_len = max(s.response_length for s in samples)
    tokens = torch.full((num, seq_len), pad_token_id, dtype=torch.long, device=HOST)
    attention_mask = torch.zeros((num, seq_len), dtype=torch.long, device=HOST)
    response_tokens = torch.full((num, resp_len), pad_token_id, dtype=torch.long, device=HOST)
    loss_masks = torch.zeros((num, resp_len), dtype=torch.float32, device=HOST)
    has_log_probs = all(len(s.rollout_log_probs) == s.response_length for s in samples)
    rollout_log_probs = torch.zeros((num, resp_len), dtype=torch.float32, device=HOST) if has_log_probs else None
    has_teacher = any(s.teacher_log_probs for s in samples) and all(
        len(s.teacher_log_probs) == s.response_length for s in samples)
    teacher_log_probs = torch.zeros((num, resp_len), dtype=torch.float32, device=HOST) if has_teacher else None
    for i, s in enumerate(samples):
        total, resp = len(s.tokens), s.response_length
        tokens[i, :total] = torch.tensor(s.tokens, dtype=torch.long, device=HOST)
        attention_mask[i, :total] = 1
        if resp == 0:
            continue
        response_tokens[i, :resp] = tokens[i, total - resp:total]
        loss_masks[i, :resp] = torch.tensor(s.loss_mask, dtype=torch.float32, device=HOST) if s.loss_mask else 1.0
        if rollout_log_probs is not None:
            rollout_log_probs[i, :resp] = torch.tensor(s.rollout_log_probs, dtype=torch.float32, device=HOST)
        if teacher_log_probs is not None:
            teacher_log_probs[i, :resp] = torch.tensor(s.teacher_log_probs, dtype=torch.float32, device=HOST)
    batch = RolloutBatch(
        tokens=tokens, attention_mask=attention_mask,
        prompt_lengths=torch.tensor([s.prompt_length for s in samples], dtype=torch.long, device=HOST),
        response_lengths=torch.tensor([s.response_length for s in samples], dtype=torch.long, device=HOST),
        response_tokens=response_tokens, loss_masks=loss_masks, rollout_log_probs=rollout_log_probs,
        advantages=torch.zeros((num, resp_len), dtype=torch.float32, device=HOST),
        rewards=torch.tensor([sample_reward(s, reward_key) for s in samples], dtype=torch.float32, device=HOST),
        routed_experts=_routed_experts(samples, seq_len, routing_shape) if routing_shape else None,
        teacher_log_probs=teacher_log_probs,
        sample_index=torch.arange(num, dtype=torch.long, device=HOST) if any(s.images for s in samples) else None)
    return batch.to(device)
