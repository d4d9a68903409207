"""PyTorch references for decode attention: the ground truth the kernels are tested against.

Both follow the `sparse_decode` contract in docs/seer-attention.md: q [B, H_q, D], k/v caches
[B, H_kv, L, D], query head i reads KV head i // (H_q // H_kv), row b sees positions
starts[b] <= t < seqlens[b], accumulation in fp32, output in q's dtype, zeros for a row that
sees no token.
"""

from __future__ import annotations

import math

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_decode_inputs(q, k_cache, v_cache, seqlens, starts, block_indices=None, block_size=64):
    """Raise ValueError/TypeError naming the argument when the inputs break the contract."""
    tensors = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "seqlens": seqlens}
    if block_indices is not None:
        tensors["block_indices"] = block_indices
    if starts is not None:
        tensors["starts"] = starts
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 3:
        raise ValueError(f"q must be [B, H_q, D], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must be [B, H_kv, L, D], got shape {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}"
        )
    b, h_q, d = q.shape
    kb, h_kv, _, kd = k_cache.shape
    if (kb, kd) != (b, d):
        raise ValueError(
            f"k_cache [B, H_kv, L, D] = {tuple(k_cache.shape)} does not match q [B, H_q, D] = "
            f"{tuple(q.shape)} in B or D"
        )
    if h_kv == 0 or h_q % h_kv:
        raise ValueError(f"H_q = {h_q} (q) is not a multiple of H_kv = {h_kv} (k_cache)")
    for name in ("q", "k_cache", "v_cache"):
        if tensors[name].dtype not in FLOAT_DTYPES:
            raise TypeError(
                f"{name} must be float16, bfloat16 or float32, got {tensors[name].dtype}"
            )
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise TypeError(
            f"q, k_cache, v_cache must share a dtype, got {q.dtype}, {k_cache.dtype}, "
            f"{v_cache.dtype}"
        )
    if block_indices is not None:
        if block_indices.dim() != 3 or tuple(block_indices.shape[:2]) != (b, h_kv):
            raise ValueError(
                f"block_indices must be [B, H_kv, S] = [{b}, {h_kv}, S], got shape "
                f"{tuple(block_indices.shape)}"
            )
        if block_indices.dtype != torch.int32:
            raise TypeError(f"block_indices must be int32, got {block_indices.dtype}")
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    for name in ("seqlens", "starts"):
        t = tensors.get(name)
        if t is None:
            continue
        if tuple(t.shape) != (b,):
            raise ValueError(f"{name} must be [B] = [{b}], got shape {tuple(t.shape)}")
        if t.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {t.dtype}")
    for name, t in tensors.items():
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")


def position_mask(seqlens, starts, length):
    """bool [B, L]: starts[b] <= t < seqlens[b]."""
    pos = torch.arange(length, device=seqlens.device)
    lo = torch.zeros_like(seqlens) if starts is None else starts
    return (pos >= lo[:, None].long()) & (pos < seqlens[:, None].long())


def block_token_mask(block_indices, length, block_size):
    """bool [B, H_kv, L]: the positions inside the selected blocks (negative entries ignored)."""
    b, h, _ = block_indices.shape
    num_blocks = -(-length // block_size)
    idx = block_indices.long()
    keep = (idx >= 0) & (idx < num_blocks)
    # Dropped entries land in one spare slot past the last block, cut off below.
    chosen = torch.zeros(b, h, num_blocks + 1, dtype=torch.bool, device=idx.device)
    chosen.scatter_(2, torch.where(keep, idx, num_blocks), True)
    return chosen[..., :num_blocks].repeat_interleave(block_size, dim=-1)[..., :length]


def masked_decode_attention(q, k_cache, v_cache, mask, scale):
    """softmax(q·kᵀ·scale) over the positions where mask [B, H_kv, L] is true; fp32 inside."""
    b, h_q, d = q.shape
    h_kv = k_cache.shape[1]
    qf = q.float().reshape(b, h_kv, h_q // h_kv, d)
    scores = torch.einsum("bhgd,bhld->bhgl", qf, k_cache.float()) * scale
    scores = scores.masked_fill(~mask[:, :, None, :], float("-inf"))
    peak = scores.amax(dim=-1, keepdim=True)
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    probs = torch.exp(scores - peak)
    total = probs.sum(dim=-1, keepdim=True)
    # Positions outside the mask may hold stale values (even NaN): 0 * NaN would leak through.
    values = v_cache.float().masked_fill(~mask[..., None], 0.0)
    out = torch.einsum("bhgl,bhld->bhgd", probs, values)
    # An empty row has probs == 0 everywhere, so dividing by 1 leaves it at zero.
    out = out / torch.where(total > 0, total, torch.ones_like(total))
    return out.reshape(b, h_q, d).to(q.dtype)


def sparse_decode_reference(
    q, k_cache, v_cache, block_indices, seqlens, block_size=64, starts=None, scale=None
):
    """Block-sparse decode attention (the contract of `rstar_kernels.sparse_decode`)."""
    check_decode_inputs(q, k_cache, v_cache, seqlens, starts, block_indices, block_size)
    length = k_cache.shape[2]
    mask = block_token_mask(block_indices, length, block_size)
    mask = mask & position_mask(seqlens, starts, length)[:, None, :]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return masked_decode_attention(q, k_cache, v_cache, mask, scale)


def dense_decode_reference(q, k_cache, v_cache, seqlens, starts=None, scale=None):
    """Dense decode attention over starts[b] <= t < seqlens[b]."""
    check_decode_inputs(q, k_cache, v_cache, seqlens, starts)
    length = k_cache.shape[2]
    mask = position_mask(seqlens, starts, length)[:, None, :].expand(-1, k_cache.shape[1], -1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return masked_decode_attention(q, k_cache, v_cache, mask, scale)
