"""Counting the places where PyTorch code would wait for a GPU: reads of tensor values on the
host (`item`, `tolist`, conversions to bool/int/float) and ops whose output size depends on the
data (`nonzero`, `unique`, `masked_select`, boolean-mask indexing). On a CPU nothing waits, but
the same Python calls are made, so counting them here counts the syncs a GPU run would make
(those made inside C++ ops are not seen).
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch

TENSOR_METHODS = (
    "item",
    "tolist",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "nonzero",
    "unique",
    "masked_select",
)
TORCH_FUNCTIONS = ("nonzero", "unique", "masked_select")


def _has_bool_mask(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


@contextmanager
def count_host_syncs() -> Iterator[Counter]:
    """Inside the block, a Counter of the calls that would wait on the device, by name."""
    counts: Counter = Counter()
    saved = [(torch.Tensor, n, getattr(torch.Tensor, n)) for n in TENSOR_METHODS]
    saved += [(torch, n, getattr(torch, n)) for n in TORCH_FUNCTIONS]
    saved += [(torch.Tensor, n, getattr(torch.Tensor, n)) for n in ("__getitem__", "__setitem__")]

    def counted(name, original):
        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return original(*args, **kwargs)

        return wrapper

    def masked(name, original):
        @functools.wraps(original)
        def wrapper(self, index, *rest):
            if _has_bool_mask(index):
                counts[f"boolean {name}"] += 1
            return original(self, index, *rest)

        return wrapper

    try:
        for owner, name, original in saved:
            wrap = masked if name in ("__getitem__", "__setitem__") else counted
            setattr(owner, name, wrap(name, original))
        yield counts
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
