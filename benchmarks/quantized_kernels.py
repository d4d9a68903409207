"""The kernels of the quantized layers on the embedded model's layer shapes: `Int8Linear`'s
row-by-row `aten._weight_int8pack_mm` and `Int4Linear`'s `aten._weight_int4pack_mm_for_cpu`, each
against its matmul (what a layer runs from its `gemm_rows` on: bfloat16 where the CPU multiplies it
natively, else float32), and where one of `llm.cpu.kernels.quantized_cpu`'s kernels runs (AMX;
AVX-512 bfloat16 dot products where the matmul is bfloat16, AVX-512 or AVX2 FMAs where it is
float32), the layer's, pinned at the rows it takes over from.

    python benchmarks/quantized_kernels.py [--threads 1] [--repeats 20] [--streaming]

CPU milliseconds of one decode step (median of `--repeats`; CPU time of this thread, so the
figures hold on a shared machine when `--threads 1`): the LM head (int8 in both schemes) and the
30 decoder layers (q, k, v, o, gate, up, down of SmolLM2-135M) at 1 to 48 rows; then the decoder
layers over a prompt's tokens (80 to 1,280 rows: a prefill, which the layers always run through
the matmul, because the packed kernels' cost grows with the rows). Random weights
of the real shapes: the kernels' time does not depend on the values. Each call reads weights
that the previous calls left in the cache, so memory-bound few-row calls look faster than in a
model, whose weights do not fit in the cache: `embedded_generation.py` measures whole steps.
`--streaming` measures instead the decode steps of 30 distinct decoder layers and the LM head
as the model runs them, the weights streaming from memory: wall ms of the pass over all of them
(so `--threads 2` counts both threads), int4's kernels only.
Prints Markdown for docs/benchmarks.md. Not a test: figures depend on the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from rstar_pipelines.llm.cpu.quantized_linear import (
    Int4Linear,
    Int8Linear,
    QuantizedLinear,
    kernel_for_batch,
    matmul_dtype,
)
from rstar_sandbox.bench import load_average, machine

HIDDEN, INTERMEDIATE, KV, VOCAB, LAYERS = 576, 1536, 192, 49152, 30
# (in, out) of each linear layer of one decoder layer: q, k, v, o, gate, up, down.
LAYER_SHAPES = [
    (HIDDEN, HIDDEN),
    (HIDDEN, KV),
    (HIDDEN, KV),
    (HIDDEN, HIDDEN),
    (HIDDEN, INTERMEDIATE),
    (HIDDEN, INTERMEDIATE),
    (INTERMEDIATE, HIDDEN),
]
ROWS = (1, 2, 4, 6, 8, 12, 16, 24, 32, 48)
PREFILL_ROWS = (80, 320, 1280)
STREAMING_ROWS = (*ROWS, 64, 96)  # up to the demo's widest decode steps


def cpu_ms(layer: QuantizedLinear, x: torch.Tensor, kernel_rows: int, repeats: int) -> float:
    """Median CPU ms of one call with the kernel that `kernel_rows` rows choose."""
    times = []
    with kernel_for_batch(layer, kernel_rows), torch.inference_mode():
        layer(x)  # first call: one-time set-up of the kernel for this shape
        for _ in range(repeats):
            start = time.thread_time()
            layer(x)
            times.append(time.thread_time() - start)
    return statistics.median(times) * 1e3


def step_ms(layers: list[QuantizedLinear], rows: int, kernel_rows: int, repeats: int) -> float:
    """CPU ms of `layers` once each at `rows` rows, by the kernel `kernel_rows` rows choose."""
    return sum(
        cpu_ms(layer, torch.randn(rows, layer.in_features), kernel_rows, repeats)
        for layer in layers
    )


def pass_ms(layers: list[QuantizedLinear], rows: int, kernel_rows: int, repeats: int) -> float:
    """Median wall ms of `layers` once each, in order, at `rows` rows, by the kernel that
    `kernel_rows` rows choose."""
    inputs = {features: torch.randn(rows, features) for features in (HIDDEN, INTERMEDIATE)}
    times = []
    with contextlib.ExitStack() as pins, torch.inference_mode():
        for layer in layers:
            pins.enter_context(kernel_for_batch(layer, kernel_rows))
        for _ in range(repeats + 1):  # the first pass sets each kernel up for its shape
            start = time.perf_counter()
            for layer in layers:
                layer(inputs[layer.in_features])
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1e3


def pins(layer: QuantizedLinear, torch_kernel: str) -> dict[str, int]:
    """Each kernel `layer` runs, by name, and the rows that pin it: torch's packed kernel, the
    matmul, and ours where one runs here."""
    kernels = {torch_kernel: 1, f"{matmul_dtype()} matmul": layer.gemm_rows}
    if layer.kernel is not None:
        kernels[layer.kernel.name] = layer.kernel_rows
    return kernels


def streaming(repeats: int) -> None:
    """The --streaming table: 30 distinct int4 decoder layers and the int8 LM head."""
    head = Int8Linear(torch.nn.Linear(HIDDEN, VOCAB, bias=False))
    layers = [
        Int4Linear(torch.nn.Linear(i, o, bias=False))
        for _ in range(LAYERS)
        for i, o in LAYER_SHAPES
    ]
    head_kernels, kernels = pins(head, "torch's int8pack"), pins(layers[0], "torch's int4pack")
    print(
        "| rows | "
        + " | ".join(
            [f"LM head, {name}" for name in head_kernels]
            + [f"30 layers, {name}" for name in kernels]
        )
        + " |"
    )
    print("| --- |" + " --- |" * (len(head_kernels) + len(kernels)))
    for rows in STREAMING_ROWS:
        cells = [pass_ms([head], rows, kernel, repeats) for kernel in head_kernels.values()]
        cells += [pass_ms(layers, rows, kernel, repeats) for kernel in kernels.values()]
        print(f"| {rows} | " + " | ".join(f"{v:.1f}" for v in cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--streaming", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.streaming:
        print(f"- machine: {machine()}, torch {torch.__version__}, {args.threads} thread(s)")
        print(f"- load average: {load_average()}; wall ms, median of {args.repeats}; streaming")
        print()
        streaming(args.repeats)
        return
    head = [Int8Linear(torch.nn.Linear(HIDDEN, VOCAB, bias=False))]
    linears = [torch.nn.Linear(i, o, bias=False) for i, o in LAYER_SHAPES]
    int8 = [Int8Linear(linear) for linear in linears]
    int4 = [Int4Linear(linear) for linear in linears]
    ours = int4[
        0
    ].kernel  # a kernel of rstar_pipelines.llm.cpu.kernels.quantized_cpu, where one runs here
    print(f"- machine: {machine()}, torch {torch.__version__}, {args.threads} thread(s)")
    print(
        f"- load average: {load_average()}; median of {args.repeats}; matmul from "
        f"{int8[0].gemm_rows} rows (int8), {int4[0].gemm_rows} (int4)"
    )
    print()
    matmul = {torch.bfloat16: "bf16 matmul", torch.float32: "float32 matmul"}[matmul_dtype()]
    print(
        f"| rows | LM head, int8pack | LM head, {matmul} | 30 layers, int8pack "
        f"| 30 layers, int8 {matmul} | 30 layers, int4pack | 30 layers, int4 {matmul} |"
        + (f" 30 layers, int4 {ours.name} |" if ours else "")
    )
    print("| --- | --- | --- | --- | --- | --- | --- |" + (" --- |" if ours else ""))
    for rows in ROWS:
        cells = [step_ms(head, rows, kernel, args.repeats) for kernel in (1, head[0].gemm_rows)]
        for layers in (int8, int4):
            cells += [
                LAYERS * step_ms(layers, rows, kernel, args.repeats)
                for kernel in (1, layers[0].gemm_rows)
            ]
        if ours:
            cells.append(LAYERS * step_ms(int4, rows, int4[0].kernel_rows, args.repeats))
        print(f"| {rows} | " + " | ".join(f"{v:.1f}" for v in cells) + " |")
    print()
    print(
        f"| prompt tokens | 30 layers, int8pack | 30 layers, int8 {matmul} "
        f"| 30 layers, int4pack | 30 layers, int4 {matmul} |"
    )
    print("| --- | --- | --- | --- | --- |")
    repeats = max(3, args.repeats // 4)
    for rows in PREFILL_ROWS:
        cells = [
            LAYERS * step_ms(layers, rows, kernel, repeats)
            for layers in (int8, int4)
            for kernel in (1, layers[0].gemm_rows)
        ]
        print(f"| {rows} | " + " | ".join(f"{v:.1f}" for v in cells) + " |")


if __name__ == "__main__":
    main()
