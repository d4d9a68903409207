"""The two kernels of `Int8Linear` on the embedded model's layer shapes: torch's row-by-row
`aten._weight_int8pack_mm` against a bfloat16 matmul over the same int8 values followed by the
row scales (what the layer runs from `GEMM_ROWS` rows on).

    python benchmarks/int8_kernels.py [--threads 1] [--repeats 20]

CPU milliseconds of one decode step (median of `--repeats`; CPU time of this thread, so the
figures hold on a shared machine when `--threads 1`): the LM head, the 30 decoder layers (q, k,
v, o, gate, up, down of SmolLM2-135M), and both together, at 1 to 48 rows. Random weights of
the real shapes: the kernels' time does not depend on the values. Prints Markdown for
docs/benchmarks.md. Not a test: figures depend on the machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from rstar_pipelines.llm.int8_linear import GEMM_ROWS, Int8Linear, kernel_for_batch
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
ROWS = (1, 2, 4, 8, 12, 16, 24, 32, 48)


def cpu_ms(layer: Int8Linear, x: torch.Tensor, kernel_rows: int, repeats: int) -> float:
    """Median CPU ms of one call with the kernel that `kernel_rows` rows choose."""
    times = []
    with kernel_for_batch(layer, kernel_rows), torch.inference_mode():
        layer(x)  # first call: one-time set-up of the kernel for this shape
        for _ in range(repeats):
            start = time.thread_time()
            layer(x)
            times.append(time.thread_time() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    head = Int8Linear(torch.nn.Linear(HIDDEN, VOCAB, bias=False))
    layers = [Int8Linear(torch.nn.Linear(i, o, bias=False)) for i, o in LAYER_SHAPES]
    print(f"- machine: {machine()}, torch {torch.__version__}, {args.threads} thread(s)")
    print(f"- load average: {load_average()}; median of {args.repeats}; GEMM_ROWS {GEMM_ROWS}")
    print()
    print(
        "| rows | LM head, int8pack | LM head, bf16 matmul | 30 layers, int8pack "
        "| 30 layers, bf16 matmul | step, int8pack | step, bf16 matmul |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for rows in ROWS:
        cells = []
        for module, count in ((head, 1), (None, LAYERS)):
            for kernel_rows in (1, GEMM_ROWS):  # the row kernel, then the matmul
                modules = [module] if module is not None else layers
                total = sum(
                    cpu_ms(m, torch.randn(rows, m.in_features), kernel_rows, args.repeats)
                    for m in modules
                )
                cells.append(total * count)
        head_rows, head_mm, layers_rows, layers_mm = cells
        step = (head_rows + layers_rows, head_mm + layers_mm)
        values = [head_rows, head_mm, layers_rows, layers_mm, *step]
        print(f"| {rows} | " + " | ".join(f"{v:.1f}" for v in values) + " |")


if __name__ == "__main__":
    main()
