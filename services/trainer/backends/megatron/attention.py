"""Core attention of the local (no Transformer Engine) layer spec through torch's scaled_dot_product_attention: the
flash / memory-efficient kernels on CUDA and the fused kernel on CPU, where megatron-core's DotProductAttention
materializes the [b, heads, s, s] scores and refuses packed (THD) rows. Causal self-attention only, padded or packed;
anything else (dropout while training padded, query-key layer scaling, sliding windows, softmax offsets) takes
Megatron's own path, which packed rows cannot.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import get_cuda_rng_tracker
from megatron.core.transformer.dot_product_attention import DotProductAttention

from services.trainer.batching.varlen import varlen_causal_attention


class SDPAttention(DotProductAttention):
    def _megatron_only(self) -> bool:
        config = self.config
        return (config.apply_query_key_layer_scaling or config.window_size is not None
                or self.softmax_offset is not None)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None) -> torch.Tensor:
        """Padded: [s, b, heads, head_dim] query, [s, b, groups, head_dim] key and value -> [s, b, heads × head_dim];
        the mask is the causal one (sequences are right-padded), so is_causal replaces it. Packed (THD): [t, heads,
        head_dim] and [t, groups, head_dim] -> [t, heads × head_dim], attention within each sequence of
        packed_seq_params.cu_seqlens_q (`varlen`)."""
        dropout = self.training and self.attention_dropout.p > 0
        if packed_seq_params is None and (dropout or self._megatron_only() or attention_bias is not None):
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
        if packed_seq_params is None:
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, head_dim]
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                                 enable_gqa=k.shape[1] != q.shape[1])
            seq, batch = out.shape[2], out.shape[0]
            return out.permute(2, 0, 1, 3).reshape(seq, batch, -1)
        if self._megatron_only() or attention_bias is not None:
            raise ValueError("packed sequences take causal attention without query-key layer scaling, sliding "
                             "windows, softmax offsets or attention bias (the local spec's torch attention)")
        # dropout draws from the model-parallel RNG, as Megatron's own attention does (TP ranks hold other heads)
        with get_cuda_rng_tracker().fork() if dropout else contextlib.nullcontext():
            out = varlen_causal_attention(query, key, value, packed_seq_params.cu_seqlens_q,
                                          packed_seq_params.max_seqlen_q, scale=self.softmax_scale,
                                          dropout_p=self.attention_dropout.p if dropout else 0.0)
        return out.reshape(out.shape[0], -1)
