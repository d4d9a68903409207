"""Block-sparse split-K flash decoding in Triton (docs/seer-attention.md).

Grid (B, H_kv, num_split): one program takes all g = H_q / H_kv query heads of a KV head as one
[BLOCK_H >= 16, D] tile, so the group's shared K/V blocks are read once. Each split runs online
softmax (base 2) over its share of the block-index list and writes a partial output and its
log-sum-exp; a combine kernel merges the splits. Runs on CUDA, or on CPU tensors under
TRITON_INTERPRET=1 (fp16/fp32 there: bf16 `tl.dot` is wrong in the interpreter).
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from functools import cache

import torch

LOG2E = 1.4426950408889634


def num_splits_heuristic(tiles, num_sms, num_blocks, max_splits=128):
    """FlashAttention-2's occupancy rule: no split when the (batch, KV head) tiles fill 80% of
    the SMs, else the fewest splits reaching 85% of the best wave efficiency."""
    if tiles >= 0.8 * num_sms:
        return 1
    max_splits = max(1, min(max_splits, num_sms, num_blocks))

    def eligible(s):
        # A split count that leaves the per-split share unchanged only adds combine work.
        return s == 1 or math.ceil(num_blocks / s) != math.ceil(num_blocks / (s - 1))

    def efficiency(s):
        waves = tiles * s / num_sms
        return waves / math.ceil(waves)

    best = max(efficiency(s) for s in range(1, max_splits + 1) if eligible(s))
    return next(s for s in range(1, max_splits + 1) if eligible(s) and efficiency(s) >= 0.85 * best)


def choose_num_split(q, tiles, num_selected):
    if q.device.type == "cuda":
        num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count
        return num_splits_heuristic(tiles, num_sms, num_selected)
    # The interpreter runs programs one after another: more splits only add work.
    return 2 if num_selected >= 8 else 1


@cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def split_kernel(
        Q, K, V, IDX, SEQLENS, STARTS, O_PART, LSE_PART,
        stride_qb, stride_qh, stride_qd,
        stride_kb, stride_kh, stride_kl, stride_kd,
        stride_vb, stride_vh, stride_vl, stride_vd,
        stride_ib, stride_ih, stride_is,
        stride_ob, stride_oh, stride_os, stride_od,
        stride_lb, stride_lh, stride_ls,
        scale_log2, length, num_selected, per_split,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        # int64 row offsets: B·H_kv·L·D passes 2^31 at long contexts.
        b = tl.cast(tl.program_id(0), tl.int64)
        h_kv = tl.cast(tl.program_id(1), tl.int64)
        split = tl.program_id(2)

        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        h_mask = offs_h < GROUP
        d_mask = offs_d < HEAD_DIM
        heads = h_kv * GROUP + offs_h

        q = tl.load(
            Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
            mask=h_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        seqlen = tl.load(SEQLENS + b)
        start = tl.load(STARTS + b)
        k_base = K + b * stride_kb + h_kv * stride_kh
        v_base = V + b * stride_vb + h_kv * stride_vh
        idx_base = IDX + b * stride_ib + h_kv * stride_ih

        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)

        lo = split * per_split
        hi = tl.minimum(lo + per_split, num_selected)
        for s in range(lo, hi):
            block = tl.load(idx_base + s * stride_is)
            if block >= 0:
                pos = block * BLOCK_SIZE + offs_n
                valid = (offs_n < BLOCK_SIZE) & (pos >= start) & (pos < seqlen) & (pos < length)
                kv_mask = valid[:, None] & d_mask[None, :]
                k = tl.load(
                    k_base + pos[:, None] * stride_kl + offs_d[None, :] * stride_kd,
                    mask=kv_mask,
                    other=0.0,
                )
                qk = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2
                qk = tl.where(valid[None, :], qk, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(qk, axis=1))
                # Until a head has seen a valid token its max is -inf; shift by 0 then.
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.math.exp2(m_i - m_safe)
                p = tl.math.exp2(qk - m_safe[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                v = tl.load(
                    v_base + pos[:, None] * stride_vl + offs_d[None, :] * stride_vd,
                    mask=kv_mask,
                    other=0.0,
                )
                acc = acc * alpha[:, None] + tl.dot(tl.cast(p, v.dtype), v, input_precision="ieee")
                m_i = m_new

        seen = l_i > 0
        out = acc / tl.where(seen, l_i, 1.0)[:, None]
        lse = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        o_part = O_PART + b * stride_ob + split * stride_os
        tl.store(
            o_part + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
            out,
            mask=h_mask[:, None] & d_mask[None, :],
        )
        tl.store(LSE_PART + b * stride_lb + heads * stride_lh + split * stride_ls, lse, mask=h_mask)

    @triton.jit
    def combine_kernel(
        O_PART, LSE_PART, OUT,
        stride_ob, stride_oh, stride_os, stride_od,
        stride_lb, stride_lh, stride_ls,
        stride_outb, stride_outh, stride_outd,
        num_split,
        HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        b = tl.cast(tl.program_id(0), tl.int64)
        h = tl.cast(tl.program_id(1), tl.int64)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        s_mask = offs_s < num_split
        d_mask = offs_d < HEAD_DIM
        lse = tl.load(
            LSE_PART + b * stride_lb + h * stride_lh + offs_s * stride_ls,
            mask=s_mask,
            other=float("-inf"),
        )
        o_part = O_PART + b * stride_ob + h * stride_oh
        part = tl.load(
            o_part + offs_s[:, None] * stride_os + offs_d[None, :] * stride_od,
            mask=s_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        peak = tl.max(lse, axis=0)
        # All splits empty: weights 0, output 0.
        weight = tl.math.exp2(lse - tl.where(peak == float("-inf"), 0.0, peak))
        total = tl.sum(weight, axis=0)
        out = tl.sum(part * weight[:, None], axis=0) / tl.where(total > 0, total, 1.0)
        tl.store(
            OUT + b * stride_outb + h * stride_outh + offs_d * stride_outd,
            tl.cast(out, OUT.dtype.element_ty),
            mask=d_mask,
        )

    return split_kernel, combine_kernel


def _pow2(n, floor=16):
    return max(floor, 1 << (n - 1).bit_length())


def sparse_decode_triton(
    q, k_cache, v_cache, block_indices, seqlens, block_size=64, *, starts=None, scale=None,
    num_split=None,
):  # fmt: skip
    """Triton backend of `rstar_kernels.sparse_decode` (inputs already validated there).

    `num_split` overrides the heuristic (tests use it to exercise the combine step)."""
    import triton

    b, h_q, d = q.shape
    h_kv, length = k_cache.shape[1], k_cache.shape[2]
    num_selected = block_indices.shape[2]
    if b == 0 or num_selected == 0 or length == 0:
        return torch.zeros_like(q)
    seqlens = seqlens.contiguous()
    starts = torch.zeros_like(seqlens) if starts is None else starts.contiguous()
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if num_split is None:
        num_split = choose_num_split(q, b * h_kv, num_selected)
    num_split = max(1, min(num_split, num_selected))
    per_split = triton.cdiv(num_selected, num_split)
    num_split = triton.cdiv(num_selected, per_split)

    o_part = torch.empty(b, h_q, num_split, d, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(b, h_q, num_split, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    split_kernel, combine_kernel = _kernels()
    group = h_q // h_kv
    on_gpu = q.device.type == "cuda"
    launch = {"num_warps": 4, "num_stages": 2} if on_gpu else {}
    with torch.cuda.device(q.device) if on_gpu else nullcontext():
        split_kernel[(b, h_kv, num_split)](
            q, k_cache, v_cache, block_indices, seqlens, starts, o_part, lse_part,
            *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_indices.stride(),
            *o_part.stride(), *lse_part.stride(),
            scale * LOG2E, length, num_selected, per_split,
            GROUP=group, HEAD_DIM=d, BLOCK_SIZE=block_size,
            BLOCK_H=_pow2(group), BLOCK_D=_pow2(d), BLOCK_N=_pow2(block_size),
            **launch,
        )  # fmt: skip
        combine_kernel[(b, h_q)](
            o_part, lse_part, out,
            *o_part.stride(), *lse_part.stride(), *out.stride(),
            num_split,
            HEAD_DIM=d, BLOCK_S=_pow2(num_split, floor=2), BLOCK_D=_pow2(d),
        )  # fmt: skip
    return out
