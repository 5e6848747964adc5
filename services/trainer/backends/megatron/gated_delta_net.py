"""megatron-core's gated delta-net layer (Qwen3-Next's and Qwen3.5's linear attention) on any device, padded or packed:
its parameters, projections and gated norm are megatron-core's; the causal convolution and the gated delta rule run
per packed sequence (each starts from a zero state), through fla's fused chunked scan and causal-conv1d's kernel on
CUDA when they are installed, else through megatron-core's exact PyTorch chunked scan and torch's conv1d.

megatron-core builds the layer only where fla is installed and refuses packed rows and context parallelism; the class
here lifts all three (fla's kernels are CUDA-only). Under context parallelism each rank all-gathers the projected
sequence slices of its CP group, runs the scan over whole sequences and keeps its own slice (the gather's backward
sums the group's gradients, as the loss's does). The gated norm's weight, replicated, sees each TP rank's heads: its
gradient is summed over the TP group.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util

import torch
import torch.nn.functional as F
from megatron.core.ssm import gated_delta_net as mcore_gdn
from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

L2NORM_EPS = 1e-6  # fla's and transformers' l2norm


def has_fused_kernels(device: torch.device) -> bool:
    """Whether fla's chunked scan and causal-conv1d's kernel run here (CUDA with both installed)."""
    return device.type == "cuda" and _fused_kernels_installed()


@functools.cache
def _fused_kernels_installed() -> bool:
    return importlib.util.find_spec("fla") is not None and importlib.util.find_spec("causal_conv1d") is not None


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(|x|² + eps) over the last dimension (fla's l2norm)."""
    return x * torch.rsqrt(x.pow(2).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def recurrent_gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor) -> torch.Tensor:
    """The gated delta rule token by token (the definition the chunked scans compute): with S the [dk, dv] state of
    each head, S ← exp(g_t)·S, then S ← S + β_t·k_t (v_t − Sᵀk_t)ᵀ, and o_t = Sᵀ q_t / sqrt(dk). query/key
    [b, s, h, dk], value [b, s, h, dv], g/beta [b, s, h] -> [b, s, h, dv] (float32 inside)."""
    dtype = query.dtype
    q, k, v, g, beta = (t.float() for t in (query, key, value, g, beta))
    q = q / q.shape[-1] ** 0.5
    state = q.new_zeros(q.shape[0], q.shape[2], k.shape[-1], v.shape[-1])
    out = []
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[..., None, None]
        delta = v[:, t] - torch.einsum("bhkv,bhk->bhv", state, k[:, t])
        state = state + torch.einsum("bhk,bhv->bhkv", k[:, t], delta * beta[:, t, :, None])
        out.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return torch.stack(out, dim=1).to(dtype)


def chunked_gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                             beta: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
    """The gated delta rule of each sequence [cu_seqlens[i], cu_seqlens[i+1]) of the rows (shapes as
    `recurrent_gated_delta_rule`'s): fla's fused chunked scan on CUDA, megatron-core's PyTorch one elsewhere."""
    if has_fused_kernels(query.device):
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        if len(cu_seqlens) == 2:
            return chunk_gated_delta_rule(query, key, value, g=g, beta=beta, use_qk_l2norm_in_kernel=False)[0]
        lengths = torch.tensor(cu_seqlens, device=query.device, dtype=torch.int32)
        return chunk_gated_delta_rule(query, key, value, g=g, beta=beta, use_qk_l2norm_in_kernel=False,
                                      cu_seqlens=lengths)[0]
    return torch.cat([mcore_gdn.torch_chunk_gated_delta_rule(
        query[:, a:b], key[:, a:b], value[:, a:b], g=g[:, a:b], beta=beta[:, a:b])[0]
        for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True)], dim=1)


@contextlib.contextmanager
def _without_fla_check():
    """megatron-core's constructor refuses to run without fla, whose kernels this layer uses only on CUDA."""
    saved = mcore_gdn.HAVE_FLA
    mcore_gdn.HAVE_FLA = True
    try:
        yield
    finally:
        mcore_gdn.HAVE_FLA = saved


class GatedDeltaNet(mcore_gdn.GatedDeltaNet):
    def __init__(self, *args, **kwargs) -> None:
        with _without_fla_check():
            super().__init__(*args, **kwargs)

    def _causal_conv(self, qkv: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
        """SiLU of the depthwise causal convolution of each sequence: [b, s, channels] -> the same."""
        weight, bias = self.conv1d.weight, self.conv1d.bias
        if has_fused_kernels(qkv.device) and len(cu_seqlens) == 2:
            from causal_conv1d import causal_conv1d_fn

            out = causal_conv1d_fn(x=qkv.transpose(1, 2).contiguous(), weight=weight.squeeze(1), bias=bias,
                                   activation="silu")
            return out.transpose(1, 2)
        pieces = []
        for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True):
            x = qkv[:, a:b].transpose(1, 2)
            pieces.append(F.silu(F.conv1d(x, weight, bias, padding=self.conv_kernel_dim - 1,
                                          groups=x.shape[1])[..., :b - a]).transpose(1, 2))
        return torch.cat(pieces, dim=1)

    def forward(self, hidden_states: torch.Tensor, attention_mask, key_value_states=None, inference_context=None,
                attention_bias=None, packed_seq_params=None, sequence_len_offset=None, *, inference_params=None,
                **kwargs):
        """[s, b, hidden] (a packed row: b 1, sequences at packed_seq_params.cu_seqlens_q) -> (output, bias);
        right padding is never seen by a real token (the convolution and the scan are causal)."""
        if inference_context is not None or inference_params is not None:
            raise NotImplementedError("the gated delta-net layer trains and scores; it keeps no inference state")
        qkvzba, _ = self.in_proj(hidden_states)  # under sequence parallelism, the whole sequence (of this CP rank)
        if self.config.context_parallel_size > 1:
            return self.out_proj(self._mix_context_parallel(qkvzba, packed_seq_params))
        seq_len, batch, _ = qkvzba.shape
        cu_seqlens = [0, seq_len] if packed_seq_params is None else \
            [int(n) for n in packed_seq_params.cu_seqlens_q.tolist()]
        out = self._mix(qkvzba.transpose(0, 1), cu_seqlens)  # [b, s, values]
        return self.out_proj(out.transpose(0, 1).contiguous())

    def _mix_context_parallel(self, qkvzba: torch.Tensor, packed_seq_params) -> torch.Tensor:
        """This CP rank's slice [s, b, ...] of the projections -> its slice of the gated norm's output, computed over
        the whole sequences of the CP group's slices (chunks r and 2·CP-1-r of each, `context_parallel.py`)."""
        from megatron.core import parallel_state

        from services.trainer.backends.fsdp.context_parallel import all_gather, chunk_index
        from services.trainer.backends.megatron.context_parallel import natural_index

        group = parallel_state.get_context_parallel_group()
        size, rank = parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()
        seq_len, batch, _ = qkvzba.shape
        if packed_seq_params is not None:  # each sequence's padded length, as the row holds it on every rank
            cu = packed_seq_params.cu_seqlens_q_padded
            cu = packed_seq_params.cu_seqlens_q if cu is None else cu
            lengths = [int(n) for n in (cu[1:] - cu[:-1]).tolist()]
        else:  # each row one sequence of seq_len·CP
            lengths = [seq_len * size] * batch
        local = qkvzba.transpose(0, 1).reshape(batch * seq_len, -1)
        natural = natural_index(tuple(lengths), size).to(qkvzba.device)
        whole = all_gather(local, group).index_select(0, natural)
        cu_seqlens = [0]
        for length in lengths:
            cu_seqlens.append(cu_seqlens[-1] + length)
        mixed = self._mix(whole[None], cu_seqlens)[0]
        mine = mixed.index_select(0, chunk_index(lengths, rank, size).to(qkvzba.device))
        return mine.view(batch, seq_len, -1).transpose(0, 1).contiguous()

    def _mix(self, qkvzba: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
        """[b, s, projections of this TP rank] -> the gated norm's output [b, s, values of this TP rank]: the causal
        convolution, the gated delta rule of each sequence [cu_seqlens[i], cu_seqlens[i+1]), the gated norm."""
        batch, seq_len, _ = qkvzba.shape
        tp = self.tp_size
        qkv, gate, beta, alpha = torch.split(
            qkvzba, [(2 * self.qk_dim + self.v_dim) // tp, self.v_dim // tp, self.num_value_heads // tp,
                     self.num_value_heads // tp], dim=-1)
        qkv = self._causal_conv(qkv, cu_seqlens)
        query, key, value = torch.split(qkv, [self.qk_dim // tp, self.qk_dim // tp, self.v_dim // tp], dim=-1)
        query = l2norm(query.reshape(batch, seq_len, -1, self.key_head_dim))
        key = l2norm(key.reshape(batch, seq_len, -1, self.key_head_dim))
        value = value.reshape(batch, seq_len, -1, self.value_head_dim)
        ratio = self.num_value_heads // self.num_key_heads
        if ratio > 1:  # value head j reads key head j // ratio
            query, key = query.repeat_interleave(ratio, dim=2), key.repeat_interleave(ratio, dim=2)
        g = -self.A_log.float().exp() * F.softplus(alpha.float() + self.dt_bias)  # in float32
        out = chunked_gated_delta_rule(query.contiguous(), key.contiguous(), value.contiguous(), g,
                                       beta.sigmoid().contiguous(), cu_seqlens)
        out = self._apply_gated_norm(out, gate.reshape(batch, seq_len, -1, self.value_head_dim))
        return out.reshape(batch, seq_len, -1)

    def _apply_gated_norm(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """out_norm(x) · silu(gate) per head, as megatron-core's (eager: its torch.compile'd one needs a compiler
        on the CPU)."""
        y = self.out_norm(x.reshape(-1, x.shape[-1]))
        return (y * F.silu(gate.reshape(-1, gate.shape[-1]).float())).to(x.dtype)


class GatedNorm(torch.nn.RMSNorm):
    """The gated delta-net's per-head RMSNorm: each TP rank normalizes its heads with the one replicated weight, so
    the weight's gradient is summed over the TP group (whether or not the sequence is parallel)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_unused) -> None:
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.tp_size = config.tensor_model_parallel_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = copy_to_tensor_model_parallel_region(self.weight) if self.tp_size > 1 else self.weight
        return F.rms_norm(x, (x.shape[-1],), weight, self.eps)
