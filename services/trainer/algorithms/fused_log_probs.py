"""Token log-probs and entropy straight from the final hidden states and the LM head, never holding the
[tokens × vocab] logits: the tokens go through in chunks, forward and backward (the backward recomputes each chunk's
logits but the last one's, which the forward keeps: a chunk is what the forward holds anyway, and all of the input
when it fits in one), and a vocab-parallel head (each tensor-parallel rank holds a slice of the vocabulary) reduces
its softmax statistics over the group. Equal to projecting onto the vocabulary and taking
`token_log_probs_and_entropy`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

DEFAULT_CHUNK_SIZE = 1024  # tokens per chunk: [1024 × 151,936] float32 logits are 0.6 GB
# off CUDA, the elements of a block of rows the softmax terms go through at once (1 MB in float32: a block stays in
# the cores' caches between its exponentials, their sum and the entropy's dot product, in few enough ops)
ROW_DOT_BLOCK = 1 << 18


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the projection runs in: autocast's where it is on (as the unfused nn.Linear would), else the
    inputs' common one."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(hidden.dtype, weight.dtype)


class _FusedLogProbs(torch.autograd.Function):
    """hidden [N, H], weight [V_local, H] -> (log_probs [N], entropy [N]) in float32, chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_size, vocab_start, valid, group, with_entropy,
                dtype, keep_last, entropy_grad):
        num = hidden.shape[0]
        w = weight[:valid].to(dtype)
        local = targets.long() - vocab_start
        in_range = (local >= 0) & (local < valid)
        local = local.clamp(0, max(valid - 1, 0))
        log_probs = torch.empty(num, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(log_probs)
        entropy = torch.empty_like(log_probs) if with_entropy else None
        # the last chunk's softmax terms stay for the backward (it would recompute them first): no extra matmul, and
        # no more memory than the chunk loop holds (released as the backward starts)
        ctx.kept = None
        for start in range(0, num, chunk_size):
            end = min(start + chunk_size, num)
            z = torch.matmul(hidden[start:end].to(dtype), w.t()).float()
            if temperature != 1.0:
                z.div_(temperature)
            peak = z.amax(dim=-1) if valid else z.new_full((end - start,), float("-inf"))
            if group is not None:
                dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
            picked = z.gather(-1, local[start:end].unsqueeze(-1)).squeeze(-1) * in_range[start:end] if valid \
                else z.new_zeros(end - start)
            z.sub_(peak.unsqueeze(-1))  # z - max
            kept = keep_last and end == num
            # z - m outlives the exponentials only for the entropy's gradient off the kept chunk
            keep_shifted = kept and with_entropy and entropy_grad
            if z.is_cuda or keep_shifted:
                exp = z.exp()
                sums = [exp.sum(dim=-1), picked - peak * in_range[start:end]]
                if with_entropy:
                    sums.append(_row_dot(exp, z))  # Σ e^(z-m)·(z-m)
                sums = torch.stack(sums)
            else:  # e^(z - m) over z in place: no second [chunk × vocab] tensor
                exp_sum, exp_dot = _exp_in_place(z, with_entropy)
                exp = z
                sums = torch.stack([exp_sum, picked - peak * in_range[start:end]]
                                   + ([exp_dot] if with_entropy else []))
            if group is not None:
                dist.all_reduce(sums, group=group)
            log_z = sums[0].log()  # log Σ e^(z - m)
            lse[start:end] = peak + log_z
            log_probs[start:end] = sums[1] - log_z
            if with_entropy:
                entropy[start:end] = log_z - sums[2] / sums[0]
            if kept:  # e^(z - m), Σ, log Σ and (for the entropy's gradient) z - m
                ctx.kept = (start, exp, sums[0], log_z, z if keep_shifted else None)
        ctx.save_for_backward(hidden, weight, local, in_range, lse, entropy if with_entropy else lse)
        ctx.args = (temperature, chunk_size, valid, dtype, with_entropy)
        ctx.set_materialize_grads(False)  # None for an output the loss does not use: its term is skipped
        if with_entropy:
            return log_probs, entropy
        return log_probs, torch.zeros_like(log_probs)

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        hidden, weight, local, in_range, lse, entropy = ctx.saved_tensors
        temperature, chunk_size, valid, dtype, with_entropy = ctx.args
        w = weight[:valid].to(dtype)
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = None  # float32, the first chunk's product, then the sum
        use_entropy = with_entropy and grad_entropy is not None
        if grad_log_probs is None:
            grad_log_probs = torch.zeros_like(lse)
        kept, ctx.kept = ctx.kept, None  # a second backward (retain_graph) recomputes every chunk
        num = hidden.shape[0]
        starts = list(range(0, num, chunk_size))
        if kept is not None and (use_entropy and kept[4] is None):
            kept = None
        if kept is not None:  # its chunk first, releasing what the forward kept before any other chunk
            starts.remove(kept[0])
            starts.insert(0, kept[0])
        for start in starts:
            end = min(start + chunk_size, num)
            h = hidden[start:end].to(dtype)
            if kept is not None and start == kept[0]:
                p = kept[1].div_(kept[2].unsqueeze(-1))  # π = e^(z - m) / Σ
                log_p = kept[4].sub_(kept[3].unsqueeze(-1)) if use_entropy else None
                kept = None
            else:
                z = torch.matmul(h, w.t()).float()
                if temperature != 1.0:
                    z.div_(temperature)
                log_p = z.sub_(lse[start:end].unsqueeze(-1))  # log π over this rank's slice
                p = log_p.exp()
            g_lp = grad_log_probs[start:end]
            # d log π_t / dz = onehot_t - π; dH / dz = -π·(log π + H)
            if use_entropy:
                grad_z = p.mul_(log_p.add_(entropy[start:end].unsqueeze(-1)).mul_(-grad_entropy[start:end]
                                                                                   .unsqueeze(-1))
                                .sub_(g_lp.unsqueeze(-1)))
            else:
                grad_z = p.mul_(-g_lp.unsqueeze(-1))
            if valid:
                rows = torch.arange(end - start, device=grad_z.device)
                grad_z[rows, local[start:end]] += g_lp * in_range[start:end]
            if temperature != 1.0:
                grad_z.div_(temperature)
            grad_z = grad_z.to(dtype)
            if grad_hidden is not None:
                grad_hidden[start:end] = torch.matmul(grad_z, w).to(hidden.dtype)
            if ctx.needs_input_grad[1]:
                part = torch.matmul(grad_z.t(), h).float()
                grad_w = part if grad_w is None else grad_w.add_(part)
            z = p = log_p = grad_z = None  # this chunk's [chunk × vocab] tensors go before the next one's come
        if ctx.needs_input_grad[1]:
            if grad_w is None:  # no tokens
                grad_w = torch.zeros(w.shape, dtype=torch.float32, device=weight.device)
            if valid < weight.shape[0]:  # the vocabulary's padding rows get none
                full = torch.zeros(weight.shape, dtype=weight.dtype, device=weight.device)
                full[:valid] = grad_w
                grad_w = full
            grad_w = grad_w.to(weight.dtype)
        return grad_hidden, grad_w, None, None, None, None, None, None, None, None, None, None


def _exp_in_place(z: torch.Tensor, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """z - m [rows × vocab] -> its rows' Σ e^(z-m) and (with_entropy) Σ e^(z-m)·(z-m), leaving e^(z-m) in z: a block
    of ROW_DOT_BLOCK elements at a time, so that each block's exponentials are summed and dotted while they are in
    cache, and no second [rows × vocab] tensor is allocated (off CUDA each is fresh memory the OS faults in)."""
    sums = z.new_empty(z.shape[0])
    dots = z.new_empty(z.shape[0]) if with_entropy else None
    rows = _block_rows(z)
    for start in range(0, z.shape[0], rows):
        block = z[start:start + rows]
        exp = block.exp()
        sums[start:start + rows] = exp.sum(dim=-1)
        if dots is not None:
            dots[start:start + rows] = (exp * block).sum(dim=-1)
        block.copy_(exp)
    return sums, dots


def _block_rows(t: torch.Tensor) -> int:
    """Rows of [rows × vocab] `t` in a block of at most ROW_DOT_BLOCK elements (one row at least)."""
    return max(1, ROW_DOT_BLOCK // max(t.shape[-1], 1))


def _row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Σ_j a[i, j]·b[i, j] for each row i of two [rows × vocab] tensors, without a third one: a batched
    matrix-vector product on CUDA; elsewhere (the host's batched product takes ~4× a multiply and a sum) the product
    and its sum in blocks of rows, ROW_DOT_BLOCK elements at most."""
    if a.device.type == "cuda":
        return torch.matmul(a.unsqueeze(-2), b.unsqueeze(-1)).view(-1)
    rows = _block_rows(a)
    if rows >= a.shape[0]:
        return (a * b).sum(dim=-1)
    return torch.cat([(a[start:start + rows] * b[start:start + rows]).sum(dim=-1)
                      for start in range(0, a.shape[0], rows)])


def fused_log_probs_and_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                                temperature: float = 1.0, with_entropy: bool = True, entropy_grad: bool = True,
                                chunk_size: int = DEFAULT_CHUNK_SIZE, vocab_size: int | None = None,
                                vocab_start: int = 0, group: dist.ProcessGroup | None = None,
                                compute_dtype: torch.dtype | None = None,
                                keep_last_chunk: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log π(target) and the entropy of π = softmax(hidden·weightᵀ / temperature), without the whole logits.

    hidden: [..., H] (the final norm's output at the positions that predict `targets`); weight: [V_local, H], the
    LM head's rows [vocab_start, vocab_start + V_local) of the vocabulary; rows at or past `vocab_size` (the padding
    of a vocab-parallel head) are left out of the softmax. group: the tensor-parallel ranks that hold the other
    slices (their statistics are all-reduced; each rank gets the gradient of its own slice, and the gradient of
    `hidden` from its slice alone: the caller sums it over the group, as Megatron's output layer does). targets:
    [...] global token ids. compute_dtype: the projection's (default: autocast's where it is on, as the unfused
    nn.Linear would run, else the inputs'); the softmax is float32. Returns (log_probs, entropy or None), [...]
    float32; entropy_grad False: the entropy is a metric only, detached. keep_last_chunk False: the backward
    recomputes every chunk (`bench/fused_head.py` compares the two).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} disagree")
    vocab_size = weight.shape[0] + vocab_start if vocab_size is None else vocab_size
    valid = max(0, min(weight.shape[0], vocab_size - vocab_start))
    group = group if group is not None and dist.get_world_size(group) > 1 else None
    dtype = compute_dtype or _compute_dtype(hidden, weight)
    flat = hidden.reshape(-1, hidden.shape[-1])
    # a backward will come
    keep_last = keep_last_chunk and torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    with torch.autocast(hidden.device.type, enabled=False):
        log_probs, entropy = _FusedLogProbs.apply(flat, weight, targets.reshape(-1), float(temperature),
                                                  int(chunk_size), int(vocab_start), valid, group, with_entropy,
                                                  dtype, keep_last, entropy_grad)
    log_probs = log_probs.view(targets.shape)
    if not with_entropy:
        return log_probs, None
    entropy = entropy.view(targets.shape)
    return log_probs, entropy if entropy_grad else entropy.detach()
