"""Core attention of the local (no Transformer Engine) layer spec through torch's scaled_dot_product_attention: the
flash / memory-efficient kernels on CUDA and the fused kernel on CPU, where megatron-core's DotProductAttention
materializes the [b, heads, s, s] scores. Causal self-attention without dropout only; anything else (dropout while
training, query-key layer scaling, sliding windows, softmax offsets) takes Megatron's own path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention


class SDPAttention(DotProductAttention):
    def _megatron_only(self) -> bool:
        config = self.config
        return ((self.training and self.attention_dropout.p > 0) or config.apply_query_key_layer_scaling
                or config.window_size is not None or self.softmax_offset is not None)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None) -> torch.Tensor:
        """[s, b, heads, head_dim] query, [s, b, groups, head_dim] key and value -> [s, b, heads × head_dim]; the
        mask is the causal one (sequences are right-padded), so is_causal replaces it."""
        if self._megatron_only() or attention_bias is not None or packed_seq_params is not None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, head_dim]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                             enable_gqa=k.shape[1] != q.shape[1])
        seq, batch = out.shape[2], out.shape[0]
        return out.permute(2, 0, 1, 3).reshape(seq, batch, -1)
