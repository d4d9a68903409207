"""SeerAttention-R kernels: block-sparse decode attention and its PyTorch references.

Triton and TileLang are imported only inside the backend modules' functions, so importing this
package loads torch alone.
"""

from __future__ import annotations

import os

from .reference import check_decode_inputs, dense_decode_reference, sparse_decode_reference

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


__all__ = [
    "BACKENDS",
    "dense_decode_reference",
    "sparse_decode",
    "sparse_decode_reference",
]

# The SeerAttention-R gate and its self-distillation.
from .distill import (  # noqa: E402
    GateTrainConfig,
    distillation_target,
    gate_kl_loss,
    topk_recall,
    train_gates,
)
from .gate import (  # noqa: E402
    AttnGate,
    GateConfig,
    SeerGates,
    capture_pre_rope,
    gate_parameter_count,
    model_family,
)

__all__ += [
    "AttnGate",
    "GateConfig",
    "GateTrainConfig",
    "SeerGates",
    "capture_pre_rope",
    "distillation_target",
    "gate_kl_loss",
    "gate_parameter_count",
    "model_family",
    "topk_recall",
    "train_gates",
]
