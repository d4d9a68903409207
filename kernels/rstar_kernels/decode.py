"""`sparse_decode`: block-sparse decode attention through one of the backends (the PyTorch
reference, Triton, TileLang), each imported when first used."""

from __future__ import annotations

import os

from .reference import check_decode_inputs, sparse_decode_reference

BACKENDS = ("torch", "triton", "tilelang")


def sparse_decode(
    q,
    k_cache,
    v_cache,
    block_indices,
    seqlens,
    block_size=64,
    backend="triton",
    *,
    starts=None,
    scale=None,
):
    """Decode attention of one new token over the selected KV blocks.

    q [B, H_q, D]; k_cache, v_cache [B, H_kv, L, D]; block_indices int32 [B, H_kv, S] (-1 padded,
    any order, no duplicates); seqlens, starts int32 [B]. Returns [B, H_q, D] in q's dtype.
    Contract: docs/seer-attention.md.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    check_decode_inputs(q, k_cache, v_cache, seqlens, starts, block_indices, block_size)
    if backend == "torch":
        return sparse_decode_reference(
            q, k_cache, v_cache, block_indices, seqlens, block_size, starts=starts, scale=scale
        )
    if backend == "triton":
        if q.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"backend='triton' needs CUDA tensors (q is on {q.device}), or TRITON_INTERPRET=1 "
                "set before triton is imported to run on the CPU"
            )
        from .decode_triton import sparse_decode_triton

        return sparse_decode_triton(
            q, k_cache, v_cache, block_indices, seqlens, block_size, starts=starts, scale=scale
        )
    if q.device.type != "cuda":
        raise ValueError(f"backend='tilelang' needs CUDA tensors, q is on {q.device}")
    from .decode_tilelang import sparse_decode_tilelang

    return sparse_decode_tilelang(
        q, k_cache, v_cache, block_indices, seqlens, block_size, starts=starts, scale=scale
    )
