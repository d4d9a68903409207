"""Attention of decode steps on the CPU (`decode_attention.c`): a few float32 queries of each
(batch, key/value head) over its keys, with each query's log-sum-exp, as torch's
`_scaled_dot_product_flash_attention_for_cpu` returns them.

Why: cascade attention (`rstar_pipelines.llm.cpu.cascade_attention`) stacks a group's rows as the
queries of one attention over the keys they share (3 samples x 3 query heads a key/value head
at candidate_solutions' decode steps); torch's flash kernel, tiled for long query blocks, reads
those keys far below what the machine streams, and attention is a large share of a small
model's decode step. This kernel reads each key and value row once for all the task's queries
and is faster than torch's at every decode shape measured (docs/benchmarks.md).

`decode_attention` returns None for inputs it does not take, and callers keep torch's kernel:
another dtype, a head dimension other than 64 or 128, more than `MAX_QUERIES` queries a task
(prefills), a mask other than one additive row of keys a batch entry, or a CPU without AVX-512.
"""

from __future__ import annotations

import ctypes

import torch

from .c_library import CLibrary

MAX_QUERIES = 64  # queries a (batch, head): decode steps; longer query blocks suit torch's tiling
HEAD_DIMS = (64, 128)

KERNEL = CLibrary(
    "decode attention AVX-512",
    "decode_attention.c",
    ("-mavx512f", "-mfma"),
    entry="decode_attention",
    argtypes=[*[ctypes.c_void_p] * 6, *[ctypes.c_int64] * 5, ctypes.c_void_p, ctypes.c_float],
)


def decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """softmax(scale * query key^T + mask) value, [batch, heads, queries, dim], and the
    log-sum-exps [batch, heads, queries] (-inf for a query whose keys are all masked), for
    float32 `query` [batch, heads, queries, dim] over `key` and `value` [batch, heads, keys, dim]
    (any strides but the last) and an additive `mask` [batch or 1, 1, 1, keys] or None; None
    where the kernel does not take them (module docstring)."""
    batch, heads, queries, dim = query.shape
    length = key.shape[2]
    if (
        query.dtype != torch.float32
        or key.dtype != torch.float32
        or value.dtype != torch.float32
        or dim not in HEAD_DIMS
        or not 1 <= queries <= MAX_QUERIES
        or length < 1
        or key.shape != (batch, heads, length, dim)
        or value.shape != key.shape
        or key.stride(-1) != 1
        or value.stride(-1) != 1
        or not _takes_mask(mask, batch, length)
        or not KERNEL.available()
    ):
        return None
    query = query.contiguous()
    out = torch.empty(batch, heads, queries, dim)
    lse = torch.empty(batch, heads, queries)
    mask_stride = 0 if mask is None or mask.shape[0] == 1 else mask.stride(0)
    strides = torch.tensor(
        [*query.stride()[:2], *key.stride()[:3], *value.stride()[:3], mask_stride],
        dtype=torch.int64,
    )
    status = KERNEL.call(
        query.data_ptr(),
        key.data_ptr(),
        value.data_ptr(),
        None if mask is None else mask.data_ptr(),
        out.data_ptr(),
        lse.data_ptr(),
        batch,
        heads,
        queries,
        length,
        dim,
        strides.data_ptr(),
        scale,
    )
    if status != 0:
        raise MemoryError(f"decode attention: no memory for {queries} x {length} scores")
    return out, lse


def _takes_mask(mask: torch.Tensor | None, batch: int, length: int) -> bool:
    return mask is None or (
        mask.dtype == torch.float32
        and mask.dim() == 4
        and mask.shape[0] in (1, batch)
        and mask.shape[1:] == (1, 1, length)
        and mask.stride(-1) == 1
    )
