"""Causal attention that also writes the block-max-pooled probability map (docs/seer-attention.md).

The map is SeerAttention-R's self-distillation target: for query row t, head i and key block j,
``block_max[t, j]`` is the largest softmax probability row t gives to any key of block j. The
Triton kernel gets it from a FlashAttention-2 forward at almost no extra cost: while streaming key
blocks it stores each row's block max of the logits, and once the row's final running max ``m``
and normaliser ``l`` are known it rewrites every stored value as ``exp(blockmax - m) / l``.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_size: int) -> int:
    """Validates shapes; returns the GQA group size g (query head i reads KV head i // g)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be [B, H, T, D], got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    b, h_q, t, d = q.shape
    b_k, h_kv, t_k, d_k = k.shape
    if (b_k, t_k, d_k) != (b, t, d):
        raise ValueError(
            f"k/v [B, H_kv, T, D] = {tuple(k.shape)} must match q's B, T, D {(b, t, d)}"
        )
    if h_q % h_kv:
        raise ValueError(f"query heads ({h_q}) must be a multiple of KV heads ({h_kv})")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if t == 0:
        raise ValueError("sequence length T must be at least 1")
    return h_q // h_kv


def attention_with_block_max_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_size: int = 64,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch version: materialises the [T, T] softmax in fp32."""
    g = _check_qkv(q, k, v, block_size)
    t, d = q.shape[2], q.shape[3]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    k = k.float().repeat_interleave(g, dim=1)
    v = v.float().repeat_interleave(g, dim=1)
    logits = q.float() @ k.transpose(-1, -2) * scale
    future = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
    probs = logits.masked_fill(future, float("-inf")).softmax(dim=-1)
    out = (probs @ v).to(q.dtype)
    n = -(-t // block_size)
    # Padding with zeros is harmless: probabilities are >= 0, and future blocks come out as 0.
    padded = torch.nn.functional.pad(probs, (0, n * block_size - t))
    block_max = padded.unflatten(-1, (n, block_size)).amax(dim=-1)
    return out, block_max


def group_max_target(
    block_max: torch.Tensor, num_kv_heads: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Turns the per-query-head map into the gate's target (docs/seer-attention.md).

    Max over each GQA group, keep only blocks strictly before the query's own block, renormalise
    each row (sum + 1e-9). Returns ``(target [B, H_kv, T, N], row_mask [B, T])``; ``row_mask``
    marks rows that have at least one previous block (the others have an all-zero target).
    """
    if block_max.dim() != 4:
        raise ValueError(f"block_max must be [B, H_q, T, N], got shape {tuple(block_max.shape)}")
    b, h_q, t, n = block_max.shape
    if num_kv_heads < 1 or h_q % num_kv_heads:
        raise ValueError(f"query heads ({h_q}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if n != -(-t // block_size):
        raise ValueError(f"block_max has {n} blocks, expected ceil(T={t} / {block_size})")
    grouped = block_max.float().unflatten(1, (num_kv_heads, h_q // num_kv_heads)).amax(dim=2)
    own_block = torch.arange(t, device=block_max.device) // block_size
    earlier = torch.arange(n, device=block_max.device)[None, :] < own_block[:, None]
    grouped = grouped * earlier
    target = grouped / (grouped.sum(dim=-1, keepdim=True) + 1e-9)
    row_mask = (own_block >= 1).expand(b, t)
    return target, row_mask


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _attn_block_max(
        Q, K, V, OUT, MAP, qk_scale, T, H_q, group, n_blocks,
        stride_qb, stride_qh, stride_qt, stride_qd,
        stride_kb, stride_kh, stride_kt, stride_kd,
        stride_vb, stride_vh, stride_vt, stride_vd,
        stride_ob, stride_oh, stride_ot, stride_od,
        stride_mb, stride_mh, stride_mt, stride_mn,
        HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
        PRECISION: tl.constexpr,
    ):  # fmt: skip
        qb = tl.program_id(0)
        bh = tl.program_id(1)
        b = tl.cast(bh // H_q, tl.int64)
        h = tl.cast(bh % H_q, tl.int64)
        h_kv = h // group
        offs_m = qb * BLOCK + tl.arange(0, BLOCK)
        offs_n = tl.arange(0, BLOCK)
        offs_d = tl.arange(0, BLOCK_D)
        row_ok = offs_m < T
        d_ok = offs_d < HEAD_DIM

        q = tl.load(
            Q + b * stride_qb + h * stride_qh
            + offs_m[:, None] * stride_qt + offs_d[None, :] * stride_qd,
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )  # fmt: skip
        k_base = K + b * stride_kb + h_kv * stride_kh
        v_base = V + b * stride_vb + h_kv * stride_vh
        map_rows = MAP + b * stride_mb + h * stride_mh + tl.cast(offs_m, tl.int64) * stride_mt

        m_i = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK], dtype=tl.float32)
        acc = tl.zeros([BLOCK, BLOCK_D], dtype=tl.float32)
        for kb in range(0, qb + 1):
            offs_k = kb * BLOCK + offs_n
            # Only the diagonal block (kb == qb) can reach past T or into the future; the masks
            # are all-true elsewhere.
            k_ok = offs_k < T
            k = tl.load(
                k_base + offs_k[None, :] * stride_kt + offs_d[:, None] * stride_kd,
                mask=k_ok[None, :] & d_ok[:, None],
                other=0.0,
            )
            v = tl.load(
                v_base + offs_k[:, None] * stride_vt + offs_d[None, :] * stride_vd,
                mask=k_ok[:, None] & d_ok[None, :],
                other=0.0,
            )
            s = tl.dot(q, k, input_precision=PRECISION) * qk_scale
            keep = (offs_k[None, :] <= offs_m[:, None]) & k_ok[None, :]
            s = tl.where(keep, s, float("-inf"))
            # Key kb * BLOCK <= every row of this query block and < T, so the max is finite.
            blk_max = tl.max(s, 1)
            tl.store(map_rows + kb * stride_mn, blk_max, mask=row_ok)
            m_new = tl.maximum(m_i, blk_max)
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            pv = tl.dot(tl.cast(p, v.dtype), v, input_precision=PRECISION)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

        # The rewrite reads values other threads of this program may have stored.
        tl.debug_barrier()
        inv_l = 1.0 / l_i
        for kb in range(0, qb + 1):
            ptrs = map_rows + kb * stride_mn
            blk_max = tl.load(ptrs, mask=row_ok, other=0.0)
            tl.store(ptrs, tl.exp2(blk_max - m_i) * inv_l, mask=row_ok)
        zeros = tl.zeros([BLOCK], dtype=tl.float32)
        for kb in range(qb + 1, n_blocks):
            tl.store(map_rows + kb * stride_mn, zeros, mask=row_ok)

        out = acc * inv_l[:, None]
        tl.store(
            OUT + b * stride_ob + h * stride_oh
            + offs_m[:, None] * stride_ot + offs_d[None, :] * stride_od,
            tl.cast(out, OUT.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )  # fmt: skip

    return _attn_block_max


def attention_with_block_max(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_size: int = 64,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention plus the block-max probability map, in one Triton kernel.

    ``q [B, H_q, T, D]``, ``k, v [B, H_kv, T, D]`` (query head i reads KV head i // (H_q/H_kv));
    ``scale`` defaults to 1/sqrt(D). Returns ``out [B, H_q, T, D]`` in q's dtype and
    ``block_max [B, H_q, T, ceil(T / block_size)]`` in fp32 (blocks wholly in the future are 0).
    Runs on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1``.
    """
    g = _check_qkv(q, k, v, block_size)
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16 (tl.dot), got {block_size}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q dtype must be float16, bfloat16 or float32, got {q.dtype}")
    if q.device != k.device or q.device != v.device:
        raise ValueError(f"q, k, v devices differ: {q.device}, {k.device}, {v.device}")

    import triton

    interpreted = triton.knobs.runtime.interpret
    if not q.is_cuda and not interpreted:
        raise ValueError("CPU tensors need TRITON_INTERPRET=1 set before triton is imported")
    b, h_q, t, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out_dtype = q.dtype
    if interpreted and q.dtype == torch.bfloat16:
        # The interpreter's bf16 tl.dot is wrong (docs/seer-attention.md, "What runs where"):
        # compute in fp32 instead.
        q, k, v = q.float(), k.float(), v.float()

    n = triton.cdiv(t, block_size)
    out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    block_max = torch.empty((b, h_q, t, n), dtype=torch.float32, device=q.device)
    grid = (n, b * h_q)
    device = torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext()
    with device:
        _kernel()[grid](
            q, k, v, out, block_max,
            scale * math.log2(math.e), t, h_q, g, n,
            *q.stride(), *k.stride(), *v.stride(), *out.stride(), *block_max.stride(),
            HEAD_DIM=d,
            BLOCK=block_size,
            BLOCK_D=max(16, triton.next_power_of_2(d)),
            # fp32 inputs stay exact; "tf32" (Triton's default) only matters for fp32 operands.
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        )  # fmt: skip
    return out, block_max
