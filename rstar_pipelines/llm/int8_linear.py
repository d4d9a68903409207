"""The int8 linear layer of `quantization="int8"` (module `quantization` says why this kernel).

`aten._weight_int8pack_mm` runs a batch row by row: on this 2-core CPU its time grows with the
rows (the LM head: 5.4 ms at 1 row, 37 at 16, 86 at 48, one thread), where a bfloat16 matmul
over the same integers grows far slower (8, 23, 36 ms) but costs more at one row, its weights
being twice the bytes (`benchmarks/int8_kernels.py`; docs/benchmarks.md, "int8 kernels"). So a
layer runs the row kernel for few rows and the matmul from `GEMM_ROWS` on. Both compute the
same products of bfloat16 activations and int8 weights with float32 sums, rounded once to
bfloat16; they differ by that rounding. A decode call pins one kernel for all its steps
(`kernel_for_batch`), so rows that leave the batch change no other row's numbers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

# From this many rows on, the bfloat16 matmul is faster (the crossover measured: 8 rows).
GEMM_ROWS = 8


class Int8Linear(torch.nn.Module):
    """A linear layer with int8 weights and one bfloat16 scale per output row (symmetric,
    absmax / 127), run on bfloat16 activations; the result comes back in the input's dtype and
    the bias is added in it."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float()
        amax = weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny)
        # The scale as the kernel reads it (bfloat16), so the weights round to that very grid.
        scale = (amax / 127).to(torch.bfloat16)
        rounded = torch.round(weight / scale.float()[:, None]).clamp(-127, 127)
        self.register_buffer("weight_int8", rounded.to(torch.int8).contiguous())
        self.register_buffer("scale", scale)
        # The same integers for the matmul: exact, |q| <= 127 fits bfloat16's 8-bit significand.
        self.register_buffer("weight_bf16", rounded.to(torch.bfloat16), persistent=False)
        self.register_buffer("scale_float", scale.float(), persistent=False)
        self.bias = linear.bias
        # The rows that choose the kernel: None, each call's own; set by `kernel_for_batch`.
        self.batch_rows: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        if (self.batch_rows or rows.shape[0]) >= GEMM_ROWS:
            sums = torch.nn.functional.linear(rows, self.weight_bf16)
            out = torch.mul(sums, self.scale_float).to(x.dtype)  # float32 by type promotion
        else:
            out = torch.ops.aten._weight_int8pack_mm(rows, self.weight_int8, self.scale)
            out = out.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights"


@contextlib.contextmanager
def kernel_for_batch(model: Any, rows: int) -> Iterator[None]:
    """Within the block, every int8 layer of `model` runs the kernel for a batch of `rows`,
    whatever the rows of each call (a decode loop whose finished rows leave the batch)."""
    layers = [module for module in model.modules() if isinstance(module, Int8Linear)]
    for layer in layers:
        layer.batch_rows = rows
    try:
        yield
    finally:
        for layer in layers:
            layer.batch_rows = None
