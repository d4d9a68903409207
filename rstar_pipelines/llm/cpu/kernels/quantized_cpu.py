"""Weight-only int4 and int8 matmuls for decode steps of several rows on the CPU, built with the
machine's C compiler on first use: int4 on Intel AMX (`int4_cpu.c`); and in `quantized_avx.c`, one
source for int4 or int8 weights, with AVX512-BF16's dot products on CPUs that multiply bfloat16
natively without AMX (AMD Zen 4, Intel Cooper Lake) or with AVX-512 or AVX2 FMAs on CPUs without
native bfloat16.

Why kernels of our own: torch's `_weight_int4pack_mm_for_cpu` unpacks the weights again for
every few rows, so its cost grows with the rows, `_weight_int8pack_mm` runs a batch row by row,
and no library on PyPI has a faster one for these CPUs (torchao's DA8W4 kernel is not in its
wheel and quantizes activations; docs/benchmarks.md). These unpack each group of 32 weights once
per call into small integers, multiply every row with them (up to 16 rows in one AMX
instruction, one dot product a row and input pair over 16 outputs, or one FMA a row and input
over 16 or 8 outputs) and scale the float32 sums afterwards, so their cost grows slowly with the
rows. Their results are float32 sums of the exact weights and do not depend on the other rows of
the batch.

A kernel is built on first use (module `c_library`); where it cannot run (the CPU lacks its
instructions, Linux does not grant AMX's tile state, no compiler) callers keep torch's kernel.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from .c_library import CLibrary

GROUP = 32  # inputs per scale and zero
BLOCK = 16  # outputs a group's unpacked weights cover (an AMX tile's columns)


def pack_amx(q: torch.Tensor) -> torch.Tensor:
    """The AMX kernel's layout of `q` ([out, in] integers in 0..15; out a multiple of 16, in of
    32): uint8 [out / 16, in / 32, 8, 32], two B-tile rows of a group in each byte's nibbles."""
    out_features, in_features = q.shape
    # Lane i of tile row j of (block, group): q[16 block + i // 2, 32 group + 2 j + i % 2].
    rows = (
        q.to(torch.uint8)
        .view(out_features // BLOCK, BLOCK, in_features // GROUP, GROUP // 2, 2)
        .permute(0, 2, 3, 1, 4)
        .reshape(out_features // BLOCK, in_features // GROUP, GROUP // 2, 2 * BLOCK)
    )
    return (rows[:, :, 0::2] | (rows[:, :, 1::2] << 4)).contiguous()


def pack_pairs(q: torch.Tensor) -> torch.Tensor:
    """The AVX kernel's layout of `q` (as `pack_amx` takes it): uint8 [out / 16, in / 32, 16, 16],
    byte o of input pair t of (block, group) holding q[16 block + o, 32 group + 2 t] in its low
    nibble and q[16 block + o, 32 group + 2 t + 1] in its high one."""
    out_features, in_features = q.shape
    pairs = (
        q.to(torch.uint8)
        .view(out_features // BLOCK, BLOCK, in_features // GROUP, GROUP // 2, 2)
        .permute(0, 2, 3, 1, 4)
    )
    return (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """The AVX kernel's layout of int8 weights `q` ([out, in] in -127..127; out a multiple of 16,
    in of 32): int8 [out / 16, in / 32, 16, 2, 16], q[16 block + o, 32 group + 2 t + p] at
    [block, group, t, p, o]."""
    out_features, in_features = q.shape
    return (
        q.to(torch.int8)
        .view(out_features // BLOCK, BLOCK, in_features // GROUP, GROUP // 2, 2)
        .permute(0, 2, 3, 4, 1)
        .contiguous()
    )


def pack_groups(values: torch.Tensor) -> torch.Tensor:
    """A per-group quantity ([out, in / 32]) in both kernels' layout: float32
    [out / 16, in / 32, 16]."""
    out_features, groups = values.shape
    return values.float().view(out_features // BLOCK, BLOCK, groups).transpose(1, 2).contiguous()


class QuantizedKernel(CLibrary):
    """One compiled kernel. int4: `mm(x, pack(q), pack_groups(scale), pack_groups(zero))`, float32
    [rows, out] = `x` ([rows, in], contiguous, of dtype `activations`) times the weights
    `(q - 8) * scale + zero`; int8: `mm(x, pack(q), scale)` (a float32 scale an output), times
    `q * scale`."""

    def __init__(
        self,
        name: str,
        source: str,
        flags: tuple[str, ...],
        activations: torch.dtype,
        pack: Callable[[torch.Tensor], torch.Tensor],
        init: str | None = None,
        weights: str = "int4",
    ):
        super().__init__(
            f"{weights} {name}",
            source,
            flags,
            entry=f"{source.removesuffix('.c')}_mm",
            argtypes=[ctypes.c_void_p, *[ctypes.c_int64] * 3, *[ctypes.c_void_p] * 4],
            defines=("-DINT8_WEIGHTS",) if weights == "int8" else (),
            init=init,
        )
        self.name, self.weights = name, weights
        self.activations, self.pack = activations, pack

    def __repr__(self) -> str:
        return f"QuantizedKernel({self.label})"

    def mm(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor | None = None,
    ) -> torch.Tensor:
        rows, in_features = x.shape
        blocks, groups = packed.shape[:2]
        if x.dtype != self.activations or not x.is_contiguous() or in_features != groups * GROUP:
            raise ValueError(
                f"{self.label} kernel: x must be contiguous {self.activations} "
                f"[rows, {groups * GROUP}], not {x.dtype} {tuple(x.shape)}"
            )
        if (zero is None) != (self.weights == "int8"):
            raise ValueError(f"{self.label} kernel: int4 weights take a zero, int8 weights none")
        out = torch.empty(rows, blocks * BLOCK)
        status = self.call(
            x.data_ptr(),
            rows,
            in_features,
            blocks * BLOCK,
            packed.data_ptr(),
            scale.data_ptr(),
            None if zero is None else zero.data_ptr(),
            out.data_ptr(),
        )
        if status != 0:
            raise MemoryError(f"{self.label} kernel: no memory for the scratch of {rows} rows")
        return out


AMX = QuantizedKernel(
    "AMX",
    "int4_cpu.c",
    ("-mavx512f", "-mavx512bw", "-mamx-tile", "-mamx-bf16"),
    torch.bfloat16,
    pack_amx,
    init="int4_cpu_init",
)
# One source with AVX512-BF16's dot products over bfloat16 activations (two inputs an
# instruction), or with FMAs in 16 float32 lanes or in 8, whose activations are bfloat16 values in
# float32 (exact), read without converting. Its int8 build runs only with the dot products: the
# FMA builds' crossovers for int8 were not measured on the CPUs that run them.
AVX512_BF16, INT8_AVX512_BF16 = (
    QuantizedKernel(
        "AVX512-BF16",
        "quantized_avx.c",
        ("-mavx512f", "-mavx512bf16", "-mfma"),
        torch.bfloat16,
        pack,
        weights=weights,
    )
    for weights, pack in (("int4", pack_pairs), ("int8", pack_int8))
)
AVX512, AVX2 = (
    QuantizedKernel(name, "quantized_avx.c", flags, torch.float32, pack_pairs)
    for name, flags in (("AVX-512", ("-mavx512f", "-mfma")), ("AVX2", ("-mavx2", "-mfma")))
)


def avx_kernel() -> QuantizedKernel | None:
    """The widest AVX FMA kernel that runs here, if any."""
    return next((kernel for kernel in (AVX512, AVX2) if kernel.available()), None)
