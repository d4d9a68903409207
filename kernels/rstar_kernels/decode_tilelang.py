"""Block-sparse split-K flash decoding in TileLang (docs/seer-attention.md).

Same design as the Triton kernel: grid (B, H_kv, num_split), the g query heads of a KV head padded
to one [64, D] tile (so Hopper's gemms can use wgmma), online softmax in base 2
over a split's share of the block-index list, partial outputs + log-sum-exp, then a combine kernel.
Every block is masked with starts/seqlens (indices may come in any order); -1 entries are skipped.

TileLang has no CPU interpreter: on a CPU host `lower_sparse_decode` still produces the CUDA
source, and `sparse_decode_tilelang` runs only on a GPU.
"""

from __future__ import annotations

import math
from functools import cache

import torch

LOG2E = 1.4426950408889634
DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def build_sparse_decode(
    heads, kv_heads, head_dim, block_size, dtype, scale, *,
    batch, length, max_selected, num_split, block_h, threads=128, num_stages=2,
):  # fmt: skip
    """The TileLang prim_func. batch, length, max_selected and num_split may be ints or
    `T.dynamic` variables (the runtime path keeps them dynamic so one compiled kernel serves
    every decode step)."""
    import tilelang.language as T

    accum = "float32"
    group = heads // kv_heads
    scale_log2 = scale * LOG2E
    per_split = (max_selected + num_split - 1) // num_split

    @T.prim_func
    def sparse_decode(
        Q: T.Tensor([batch, heads, head_dim], dtype),
        K: T.Tensor([batch, kv_heads, length, head_dim], dtype),
        V: T.Tensor([batch, kv_heads, length, head_dim], dtype),
        Indices: T.Tensor([batch, kv_heads, max_selected], "int32"),
        Seqlens: T.Tensor([batch], "int32"),
        Starts: T.Tensor([batch], "int32"),
        LsePart: T.Tensor([batch, heads, num_split], accum),
        OutPart: T.Tensor([batch, heads, num_split, head_dim], accum),
        Out: T.Tensor([batch, heads, head_dim], dtype),
    ):
        with T.Kernel(batch, kv_heads, num_split, threads=threads) as (bb, hh, ss):
            q_s = T.alloc_shared([block_h, head_dim], dtype)
            k_s = T.alloc_shared([block_size, head_dim], dtype)
            v_s = T.alloc_shared([block_size, head_dim], dtype)
            scores = T.alloc_fragment([block_h, block_size], accum)
            probs = T.alloc_fragment([block_h, block_size], dtype)
            acc = T.alloc_fragment([block_h, head_dim], accum)
            row_max = T.alloc_fragment([block_h], accum)
            prev_max = T.alloc_fragment([block_h], accum)
            shift = T.alloc_fragment([block_h], accum)
            alpha = T.alloc_fragment([block_h], accum)
            row_sum = T.alloc_fragment([block_h], accum)
            denom = T.alloc_fragment([block_h], accum)

            start = Starts[bb]
            seqlen = T.min(Seqlens[bb], length)
            for i, d in T.Parallel(block_h, head_dim):
                q_s[i, d] = T.if_then_else(i < group, Q[bb, hh * group + i, d], T.cast(0, dtype))
            T.fill(acc, 0)
            T.fill(denom, 0)
            T.fill(row_max, -T.infinity(accum))

            lo = ss * per_split
            count = T.max(T.min(per_split, max_selected - lo), 0)
            for n in T.Pipelined(count, num_stages=num_stages):
                block = Indices[bb, hh, lo + n]
                if block >= 0:
                    first = block * block_size
                    T.copy(K[bb, hh, first : first + block_size, :], k_s)
                    T.clear(scores)
                    T.gemm(q_s, k_s, scores, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                    for i, j in T.Parallel(block_h, block_size):
                        scores[i, j] = T.if_then_else(
                            (first + j >= start) & (first + j < seqlen),
                            scores[i, j] * scale_log2,
                            -T.infinity(accum),
                        )
                    T.copy(row_max, prev_max)
                    T.reduce_max(scores, row_max, dim=1, clear=True)
                    for i in T.Parallel(block_h):
                        row_max[i] = T.max(row_max[i], prev_max[i])
                        # A row that has seen no valid token keeps max -inf; shift by 0 then.
                        shift[i] = T.if_then_else(row_max[i] == -T.infinity(accum), 0, row_max[i])
                        alpha[i] = T.exp2(prev_max[i] - shift[i])
                    for i, j in T.Parallel(block_h, block_size):
                        scores[i, j] = T.exp2(scores[i, j] - shift[i])
                    T.reduce_sum(scores, row_sum, dim=1)
                    for i in T.Parallel(block_h):
                        denom[i] = denom[i] * alpha[i] + row_sum[i]
                    T.copy(scores, probs)
                    for i, d in T.Parallel(block_h, head_dim):
                        acc[i, d] *= alpha[i]
                    # Masked positions have probability 0, but 0 * NaN from stale cache rows
                    # would still poison the sum: zero V outside [start, seqlen).
                    for j, d in T.Parallel(block_size, head_dim):
                        v_s[j, d] = T.if_then_else(
                            (first + j >= start) & (first + j < seqlen),
                            V[bb, hh, first + j, d],
                            T.cast(0, dtype),
                        )
                    T.gemm(probs, v_s, acc, policy=T.GemmWarpPolicy.FullRow)

            for i, d in T.Parallel(block_h, head_dim):
                if i < group:
                    OutPart[bb, hh * group + i, ss, d] = acc[i, d] / T.if_then_else(
                        denom[i] > 0, denom[i], 1
                    )
            for i in T.Parallel(block_h):
                if i < group:
                    LsePart[bb, hh * group + i, ss] = T.if_then_else(
                        denom[i] > 0, T.log2(denom[i]) + row_max[i], -T.infinity(accum)
                    )

        with T.Kernel(heads, batch, threads=128) as (hh, bb):
            total = T.alloc_fragment([head_dim], accum)
            peak = T.alloc_local([1], accum)
            weight = T.alloc_local([1], accum)
            weight_sum = T.alloc_local([1], accum)
            peak[0] = -T.infinity(accum)
            for s in T.serial(num_split):
                peak[0] = T.max(peak[0], LsePart[bb, hh, s])
            # Every split empty: all weights are exp2(-inf) = 0 and the row stays zero.
            peak[0] = T.if_then_else(peak[0] == -T.infinity(accum), 0, peak[0])
            weight_sum[0] = 0
            T.clear(total)
            for s in T.serial(num_split):
                weight[0] = T.exp2(LsePart[bb, hh, s] - peak[0])
                weight_sum[0] += weight[0]
                for d in T.Parallel(head_dim):
                    total[d] += OutPart[bb, hh, s, d] * weight[0]
            for d in T.Parallel(head_dim):
                Out[bb, hh, d] = T.cast(
                    total[d] / T.if_then_else(weight_sum[0] > 0, weight_sum[0], 1), dtype
                )

    return sparse_decode


def default_block_h(group):
    """Rows of the query tile: 64 (Hopper's wgmma needs M = 64, and with 4 warps splitting the
    rows every warp keeps a full m16 tile on older GPUs too)."""
    return max(64, 1 << (group - 1).bit_length())


def lower_sparse_decode(
    batch, heads, kv_heads, head_dim, max_selected_blocks, block_size=64,
    dtype="float16", target="cuda -arch=sm_90", *, num_split=1, scale=None,
):  # fmt: skip
    """CUDA source of the kernel for one shape (works on a host without a GPU). The cache length
    stays dynamic."""
    import tilelang
    import tilelang.language as T

    _check_config(heads, kv_heads, head_dim, block_size)
    arch = _arch(target)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    func = build_sparse_decode(
        heads, kv_heads, head_dim, block_size, dtype, scale,
        batch=batch, length=T.dynamic("length"), max_selected=max_selected_blocks,
        num_split=num_split, block_h=default_block_h(heads // kv_heads),
    )  # fmt: skip
    with _target(arch) as target:
        return tilelang.lower(func, target=target).kernel_source


def _arch(target):
    """80 from "cuda -arch=sm_80"; this TileLang takes the architecture as a target attribute."""
    if not target.startswith("cuda") or "sm_" not in target:
        raise ValueError(f"target must look like 'cuda -arch=sm_90', got {target!r}")
    return int(target.split("sm_")[1].rstrip("a"))


def _target(arch):
    """A CUDA target; entered as a context because layout inference asks for the current one."""
    from tilelang import tvm

    return tvm.target.Target({"kind": "cuda", "arch": f"sm_{arch}"})


def _check_config(heads, kv_heads, head_dim, block_size):
    if head_dim % 16 or block_size % 16:
        raise ValueError(
            f"tilelang backend needs head_dim and block_size multiples of 16, got head_dim="
            f"{head_dim}, block_size={block_size}"
        )
    if heads // kv_heads > 128:
        raise ValueError(f"tilelang backend supports H_q / H_kv <= 128, got {heads // kv_heads}")


@cache
def _compiled(heads, kv_heads, head_dim, block_size, dtype, scale, arch):
    """One compiled kernel per head layout, dtype and scale; batch, cache length, number of
    selected blocks and number of splits are dynamic."""
    import tilelang
    import tilelang.language as T

    func = build_sparse_decode(
        heads, kv_heads, head_dim, block_size, dtype, scale,
        batch=T.dynamic("batch"), length=T.dynamic("length"),
        max_selected=T.dynamic("max_selected"), num_split=T.dynamic("num_split"),
        block_h=default_block_h(heads // kv_heads),
    )  # fmt: skip
    with _target(arch) as target:
        return tilelang.compile(func, out_idx=[-1], target=target)


def sparse_decode_tilelang(
    q, k_cache, v_cache, block_indices, seqlens, block_size=64, *, starts=None, scale=None,
    num_split=None,
):  # fmt: skip
    """TileLang backend of `rstar_kernels.sparse_decode` (inputs validated there; CUDA only)."""
    from .decode_triton import num_splits_heuristic

    if q.dtype not in DTYPES:
        raise TypeError(f"tilelang backend supports float16 and bfloat16, got {q.dtype}")
    b, h_q, d = q.shape
    h_kv, length = k_cache.shape[1], k_cache.shape[2]
    num_selected = block_indices.shape[2]
    _check_config(h_q, h_kv, d, block_size)
    if b == 0 or num_selected == 0 or length == 0:
        return torch.zeros_like(q)
    if starts is None:
        starts = torch.zeros_like(seqlens)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    major, minor = torch.cuda.get_device_capability(q.device)
    if num_split is None:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count
        num_split = num_splits_heuristic(b * h_kv, sms, num_selected)
    num_split = max(1, min(num_split, num_selected))
    kernel = _compiled(h_q, h_kv, d, block_size, DTYPES[q.dtype], scale, major * 10 + minor)
    lse_part = torch.empty(b, h_q, num_split, dtype=torch.float32, device=q.device)
    out_part = torch.empty(b, h_q, num_split, d, dtype=torch.float32, device=q.device)
    with torch.cuda.device(q.device):
        return kernel(
            q.contiguous(), k_cache.contiguous(), v_cache.contiguous(), block_indices.contiguous(),
            seqlens.contiguous(), starts.contiguous(), lse_part, out_part,
        )  # fmt: skip
