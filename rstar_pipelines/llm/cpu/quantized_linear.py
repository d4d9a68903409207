"""The quantized linear layers of `quantization="int8"` and `"int4"` (module `quantization` says
which layers each scheme quantizes, and why these kernels).

Each layer has two kernels over the same weights: a weight-only kernel that reads the packed
integers (fastest for few rows: decoding few rows is memory-bound on a CPU) and a matmul over the
dequantized weights, which those kernels cannot match for many rows
(`benchmarks/quantized_kernels.py`; docs/benchmarks.md). The matmul is bfloat16 where the CPU
multiplies bfloat16 natively (AVX512-BF16, AMX) and float32 elsewhere (an AVX2 CPU emulates bfloat16
at a quarter of float32's speed), over a copy of the dequantized weights in that dtype kept beside
the packed ones: memory for speed (float32: 4 bytes a weight), while a step of few rows still reads
only the packed bytes. A forward of one token a row (a decode step) picks by its rows: the matmul
from `gemm_rows` on. A decode call pins one kernel for all its steps (`kernel_for_batch`), so rows
that leave the batch change no other row's numbers. A forward of several tokens a row (a prefill)
always takes the matmul, pinned or not: its rows are tokens, hundreds for one prompt, and the packed
kernels' cost grows with them far faster than the matmul's, and whatever the batch, a prompt's cache
is the same. Activations are rounded to bfloat16 in both kernels and never quantized, so under one
kernel a row's result does not depend on the other rows of its batch (the float32 matmul pads to
`FLOAT32_MATMUL_ROWS` for that).

- `Int8Linear`: int8 weights, one scale per output row (symmetric, absmax / 127);
  `aten._weight_int8pack_mm` runs a batch row by row, so its cost grows with every row and the
  matmul takes over from 8 rows (12 where it is float32). On a CPU with AVX512-BF16 but no AMX, the
  int8 build of our AVX-512 dot-product kernel runs instead from 1 row up to 96
  (`INT8_KERNEL_ROWS`): it unpacks the weights once a call and reads half the bytes of the bfloat16
  matmul. All compute the same products of bfloat16 activations and the int8 values with float32
  sums; torch's kernel and the bfloat16 matmul round the sums to bfloat16 (ours and the float32
  matmul do not).
- `Int4Linear`: 4-bit weights in groups of 32 inputs, one scale and one zero per group, the layout
  of GGUF's Q4_1 (`w = scale * q + min`, q in 0..15), which the embedded model's decoder layers ship
  in: fitted to each group's minimum and maximum, the groups land on the file's own grid, up to the
  bfloat16 rounding of the scale and zero the kernel reads. Torch's
  `aten._weight_int4pack_mm_for_cpu` reads half the bytes of int8 but unpacks the weights again for
  every few rows. The kernels of `kernels.quantized_cpu` unpack them once a call: on a CPU
  with AMX, from 4 rows up to the matmul's 48; on a CPU without native bfloat16, whose matmul is
  float32, the AVX-512 or AVX2 kernel, from 4-5 rows up to 32-48 (`INT4_KERNEL_ROWS`), where torch's
  kernel alone would hand over to the float32 matmul at 12; on a CPU with AVX512-BF16 but no AMX
  (AMD Zen 4), the AVX-512 kernel of bfloat16 dot products, from 5 rows up to 64, where torch's
  kernel handed over to the bfloat16 matmul at 32. Torch's kernel and the bfloat16 matmul differ
  from the exact weights' float32 sums by bfloat16 roundings (of the sums, of the weights); our
  kernels and the float32 matmul compute those sums.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

from rstar_kernels import cpu_features

from . import capabilities
from .kernels import quantized_cpu

# From this many rows on, the matmul is faster (measured crossovers: 8 rows for int8, 24-32 for
# int4 against a bfloat16 matmul; 10-16 for both against a float32 one; docs/benchmarks.md).
GEMM_ROWS = 8
INT4_GEMM_ROWS = 32
FLOAT32_GEMM_ROWS = 12
# A float32 matmul of fewer rows takes other paths in MKL (a matrix-vector product for one row,
# other splits among two threads for 5-7 or 9-11) whose sums differ in the last bits from those
# of 12 rows and more; padded to this many, a row's result does not depend on its batch.
FLOAT32_MATMUL_ROWS = 12
# The kernels of `kernels.quantized_cpu`, where one runs, take over from torch's int4 kernel
# from the first of these rows and keep ahead of the matmul up to the second (for AVX512-BF16, 64:
# past the 48 rows of the demo's candidate_solutions steps): the crossovers of each build measured
# by `benchmarks/quantized_kernels.py` on the 30 decoder layers, their weights streaming from
# memory as in the model (docs/benchmarks.md has the figures). Torch's kernel unpacks the weights
# again for every few rows, ours once a call, so below the first figure torch's is as fast and
# from it on ours pulls ahead; the matmul's cost barely grows with the rows and overtakes ours at
# the second.
INT4_KERNEL_ROWS = {"AMX": (4, 48), "AVX512-BF16": (5, 64), "AVX-512": (5, 32), "AVX2": (4, 48)}
# Where int8 layers run a kernel of ours (AVX512-BF16 without AMX), it takes over from torch's
# row-by-row kernel from the first of these rows and keeps ahead of the bfloat16 matmul below the
# second, as measured on the LM head (49,152 x 576) with its weights streaming (docs/benchmarks.md);
# not measured past 96.
INT8_KERNEL_ROWS = {"AVX512-BF16": (1, 97)}
INT4_GROUP = 32  # inputs per scale and zero: Q4_1's block
INT4_ROWS_MULTIPLE = 16  # the packed kernels pack output rows in sixteens


@functools.cache
def matmul_dtype() -> torch.dtype:
    """The dtype of the matmul's weights and activations: bfloat16 where the CPU multiplies it
    natively, else float32 (over weights dequantized once, the same values): emulated, bfloat16's
    matmul is several times slower than float32's (docs/benchmarks.md)."""
    return torch.bfloat16 if cpu_features.native_bfloat16() else torch.float32


def int8_kernel() -> quantized_cpu.QuantizedKernel | None:
    """The kernel of `kernels.quantized_cpu` that int8 layers run here, if any: the AVX-512
    dot products of bfloat16 where int4 layers run them (AVX512-BF16 without AMX)."""
    kernel = quantized_cpu.INT8_AVX512_BF16
    return kernel if int4_kernel() is quantized_cpu.AVX512_BF16 and kernel.available() else None


def int4_kernel() -> quantized_cpu.QuantizedKernel | None:
    """The kernel of `kernels.quantized_cpu` that int4 layers run here, if any: AMX; else the
    AVX-512 dot products of bfloat16 where the matmul is bfloat16 (AVX512-BF16), or the AVX-512 or
    AVX2 FMAs where it is float32."""
    if quantized_cpu.AMX.available():
        return quantized_cpu.AMX
    if matmul_dtype() == torch.bfloat16:
        return quantized_cpu.AVX512_BF16 if quantized_cpu.AVX512_BF16.available() else None
    return quantized_cpu.avx_kernel()


class QuantizedLinear(torch.nn.Module):
    """What the quantized layers share: the shapes, the bias, and the choice of kernel."""

    gemm_rows = GEMM_ROWS

    @staticmethod
    def fits(linear: torch.nn.Linear) -> bool:
        """Whether the layer's shape fits the packed kernels' blocks: inputs in groups of
        `INT4_GROUP`, outputs in `INT4_ROWS_MULTIPLE`s (int4 layers take only such layers; an int8
        layer of another shape keeps torch's kernels)."""
        return (
            linear.in_features % INT4_GROUP == 0 and linear.out_features % INT4_ROWS_MULTIPLE == 0
        )

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias
        self.matmul_dtype = matmul_dtype()
        if self.matmul_dtype == torch.float32:
            self.gemm_rows = FLOAT32_GEMM_ROWS
        # The rows that choose the kernel: None, each call's own; set by `kernel_for_batch`.
        self.batch_rows: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        several_tokens = x.dim() > 2 and x.shape[-2] > 1  # [batch, tokens, in_features]
        batch_rows = self.batch_rows or rows.shape[0]
        if several_tokens or batch_rows >= self.gemm_rows:
            out = self._matmul(rows)
        else:
            out = self._packed(rows, batch_rows)
        out = out.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def _matmul(self, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _linear(self, rows: torch.Tensor) -> torch.Tensor:
        """`rows` times the layer's `weight_matmul` in its dtype, padded to `FLOAT32_MATMUL_ROWS`
        in float32."""
        weight = self.weight_matmul
        x = rows.to(weight.dtype)
        short = FLOAT32_MATMUL_ROWS - x.shape[0]
        if weight.dtype != torch.float32 or short <= 0:
            return torch.nn.functional.linear(x, weight)
        return torch.nn.functional.linear(torch.nn.functional.pad(x, (0, 0, 0, short)), weight)[
            : rows.shape[0]
        ]

    def _packed(self, rows: torch.Tensor, batch_rows: int) -> torch.Tensor:
        raise NotImplementedError


class Int8Linear(QuantizedLinear):
    """A linear layer with int8 weights and one bfloat16 scale per output row (symmetric,
    absmax / 127), run on bfloat16 activations; the result comes back in the input's dtype and
    the bias is added in it."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__(linear)
        weight = linear.weight.detach().float()
        amax = weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny)
        # The scale as the kernel reads it (bfloat16), so the weights round to that very grid.
        scale = (amax / 127).to(torch.bfloat16)
        rounded = torch.round(weight / scale.float()[:, None]).clamp(-127, 127)
        self.register_buffer("weight_int8", rounded.to(torch.int8).contiguous())
        self.register_buffer("scale", scale)
        # The same integers for the matmul: exact, |q| <= 127 fits bfloat16's 8-bit significand.
        self.register_buffer("weight_matmul", rounded.to(self.matmul_dtype), persistent=False)
        self.register_buffer("scale_float", scale.float(), persistent=False)
        # A kernel of our own, where one runs and the layer's shape fits its blocks, and its copy
        # of the same integers.
        self.kernel = int8_kernel() if self.fits(linear) else None
        if self.kernel is not None:
            self.kernel_rows, self.gemm_rows = INT8_KERNEL_ROWS[self.kernel.name]
            self.register_buffer("weight_packed", self.kernel.pack(rounded), persistent=False)

    def _matmul(self, rows: torch.Tensor) -> torch.Tensor:
        sums = self._linear(rows)
        return torch.mul(sums, self.scale_float)  # float32 by type promotion

    def _packed(self, rows: torch.Tensor, batch_rows: int) -> torch.Tensor:
        if self.kernel is not None and batch_rows >= self.kernel_rows:
            return self.kernel.mm(rows, self.weight_packed, self.scale_float)
        if not capabilities.int8_packed_matmul():
            return self._matmul(rows)
        return torch.ops.aten._weight_int8pack_mm(rows, self.weight_int8, self.scale)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights"


class Int4Linear(QuantizedLinear):
    """A linear layer with 4-bit weights in groups of `INT4_GROUP` inputs, each group with a
    bfloat16 scale and zero (`w = (q - 8) * scale + zero`, the kernel's form of Q4_1's
    `scale * q + min`), run on bfloat16 activations; the result comes back in the input's dtype
    and the bias is added in it. Takes layers whose inputs are a multiple of `INT4_GROUP` and
    outputs a multiple of `INT4_ROWS_MULTIPLE` (`fits`).

    The groups' scales and zeros are fitted to each group's minimum and maximum, or, with
    `grid` (another layer's `scales_and_zeros`, of a model this one was trained from), taken
    from it: the weights round to that grid, and those past its ends take its ends."""

    gemm_rows = INT4_GEMM_ROWS

    def __init__(self, linear: torch.nn.Linear, grid: torch.Tensor | None = None):
        if not self.fits(linear):
            raise ValueError(
                f"an int4 layer needs inputs in groups of {INT4_GROUP} and outputs in "
                f"{INT4_ROWS_MULTIPLE}s, not {linear.in_features} -> {linear.out_features}"
            )
        super().__init__(linear)
        weight = linear.weight.detach().float()
        groups = weight.view(self.out_features, -1, INT4_GROUP)
        if grid is not None:
            if grid.shape != (groups.shape[1], self.out_features, 2):
                raise ValueError(
                    f"a grid of shape {tuple(grid.shape)} for a layer of "
                    f"{self.in_features} -> {self.out_features}"
                )
            scale, zero = grid.transpose(0, 1).unbind(-1)
        else:
            low, high = groups.amin(dim=-1), groups.amax(dim=-1)
            tiny = torch.finfo(torch.bfloat16).tiny
            # Scale and zero as the kernel reads them (bfloat16): a Q4_1 group's minimum and
            # maximum are its q = 0 and q = 15.
            scale = ((high - low) / 15).clamp(min=tiny).to(torch.bfloat16)
            zero = (low + 8 * scale.float()).to(torch.bfloat16)
        # Each weight rounded to the grid they make.
        steps = (groups - zero.float()[..., None]) / scale.float()[..., None]
        q = (torch.round(steps) + 8).clamp(0, 15)
        packed = None
        if capabilities.int4_packed_matmul():
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                q.view(self.out_features, self.in_features).to(torch.int32), 1
            )
        self.register_buffer("weight_int4", packed)
        # [groups, out_features, 2], the kernel's layout.
        self.register_buffer(
            "scales_and_zeros", torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
        )
        # A kernel of our own, where one runs (`int4_kernel`), and its copy of the same integers,
        # scales and zeros (float32 from bfloat16: the same grid).
        self.kernel = int4_kernel()
        if self.kernel is not None:
            self.kernel_rows, self.gemm_rows = INT4_KERNEL_ROWS[self.kernel.name]
            self.register_buffer(
                "weight_packed", self.kernel.pack(q.view(self.out_features, -1)), persistent=False
            )
            self.register_buffer("scale_packed", quantized_cpu.pack_groups(scale), persistent=False)
            self.register_buffer("zero_packed", quantized_cpu.pack_groups(zero), persistent=False)
        dequantized = (q - 8) * scale.float()[..., None] + zero.float()[..., None]
        self.register_buffer(
            "weight_matmul",
            dequantized.view(self.out_features, self.in_features).to(self.matmul_dtype),
            persistent=False,
        )

    def _matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return self._linear(rows)

    def _packed(self, rows: torch.Tensor, batch_rows: int) -> torch.Tensor:
        if self.kernel is not None and batch_rows >= self.kernel_rows:
            x = rows.to(self.kernel.activations)
            return self.kernel.mm(x, self.weight_packed, self.scale_packed, self.zero_packed)
        if self.weight_int4 is None:
            return self._matmul(rows)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            rows, self.weight_int4, INT4_GROUP, self.scales_and_zeros
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"int4 weights in groups of {INT4_GROUP}"
        )


@contextlib.contextmanager
def kernel_for_batch(model: Any, rows: int) -> Iterator[None]:
    """Within the block, every quantized layer of `model` runs the kernel for a batch of `rows`
    in its forwards of one token a row, whatever the rows of each (a decode loop whose finished
    rows leave the batch); forwards of several tokens a row take the matmul still."""
    layers = [module for module in model.modules() if isinstance(module, QuantizedLinear)]
    for layer in layers:
        layer.batch_rows = rows
    try:
        yield
    finally:
        for layer in layers:
            layer.batch_rows = None
