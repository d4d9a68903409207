"""The decode attention kernel (`llm.cpu.kernels.decode_attention_cpu`) against torch's CPU flash
kernel, which cascade attention ran before, at the embedded model's decode-step shapes; then the
model over the demo's `candidate_solutions` shape with each.

    python benchmarks/decode_attention.py [--threads 2] [--repeats 5] [--rounds 2]

Kernel: wall ms of one decode step's attention over the 30 layers (3 key/value heads of 64), a
call a layer, keys and values distinct per layer so that they come from memory as in the model
("streaming"), then the same keys for every layer ("in the cache"); median of `--repeats`.
Shapes: the shared part of `candidate_solutions`' steps (16 prompts a batch, 3 samples x 3 query
heads = 9 queries a head, over 300-1,000 prompt tokens), of MCTS expansions (1-2 prompts x 4
samples = 12 queries), and the own part (48 rows, 3 queries, over 150 generated tokens).

Model: 16 demo word problems as chats x 3 samples, 192 new tokens, the embedded model as the
demo loads it, cascade attention's kernel switched between ours and torch's, alternating for
`--rounds`; tokens/s of the call, prefill included. Their samples can differ (float sums in
another order), hence tokens/s, not seconds. Prints Markdown for docs/benchmarks.md. Not a test:
figures depend on the machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.embedded_generation import chats
from rstar_pipelines.llm import SamplingParams
from rstar_pipelines.llm.cpu import cascade_attention
from rstar_pipelines.llm.cpu.backend import CpuTransformersLLM
from rstar_pipelines.llm.cpu.kernels.decode_attention_cpu import decode_attention
from rstar_sandbox.bench import load_average, machine

LAYERS, KV_HEADS, DIM = 30, 3, 64
SHAPES = [
    ("candidate_solutions, shared part", 16, 9, 300),
    ("candidate_solutions, shared part", 16, 9, 500),
    ("candidate_solutions, shared part", 16, 9, 1000),
    ("MCTS expansion, shared part", 1, 12, 800),
    ("MCTS expansions, shared part", 2, 12, 800),
    ("own part, 48 rows", 48, 3, 150),
]


def torch_flash(query, key, value, mask, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, attn_mask=mask, scale=scale
    )


def step_ms(attend, batch: int, queries: int, length: int, repeats: int, streaming: bool) -> float:
    distinct = LAYERS if streaming else 1
    queries_ = [torch.randn(batch, KV_HEADS, queries, DIM) for _ in range(LAYERS)]
    keys = [torch.randn(batch, KV_HEADS, length, DIM) for _ in range(distinct)]
    values = [torch.randn(batch, KV_HEADS, length, DIM) for _ in range(distinct)]
    mask = torch.zeros(batch, 1, 1, length)
    times = []
    for _ in range(repeats + 1):  # the first pass warms up
        start = time.perf_counter()
        for layer in range(LAYERS):
            attend(queries_[layer], keys[layer % distinct], values[layer % distinct], mask, 0.125)
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times[1:])


def kernel_table(repeats: int) -> list[str]:
    rows = [
        "| decode step | groups | queries a head | keys | torch's flash, streaming | ours, "
        "streaming | torch's flash, in the cache | ours, in the cache |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, batch, queries, length in SHAPES:
        figures = [
            step_ms(attend, batch, queries, length, repeats, streaming)
            for streaming in (True, False)
            for attend in (torch_flash, decode_attention)
        ]
        rows.append(
            f"| {name} | {batch} | {queries} | {length} | "
            + " | ".join(f"{ms:.1f}" for ms in figures)
            + " |"
        )
    return rows


def model_table(rounds: int) -> list[str]:
    llm = CpuTransformersLLM("embedded")
    llm.prefix_cache = None
    prompts = chats(16, offset=8)
    params = SamplingParams(n=3, temperature=0.8, top_p=0.95, max_tokens=192, seed=0)
    ways = {"ours": decode_attention, "torch's flash": lambda *args: None}
    speeds: dict[str, list[float]] = {way: [] for way in ways}
    try:
        for _ in range(rounds):
            for way, kernel in ways.items():
                cascade_attention.decode_attention = kernel
                start = time.perf_counter()
                results = llm.generate(prompts, params)
                seconds = time.perf_counter() - start
                tokens = sum(c.completion_tokens for samples in results for c in samples)
                speeds[way].append(tokens / seconds)
    finally:
        cascade_attention.decode_attention = decode_attention
    rows = ["| 16 prompts x 3 samples, 192 tokens | tokens/s (each round) | median |"]
    rows.append("| --- | --- | --- |")
    for way, figures in speeds.items():
        each = " / ".join(f"{s:.1f}" for s in figures)
        rows.append(f"| {way} | {each} | {statistics.median(figures):.1f} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    before = load_average()
    print(f"Machine: {machine()}; {args.threads} threads; load average {before} before.\n")
    print("\n".join(kernel_table(args.repeats)))
    print()
    print("\n".join(model_table(args.rounds)))


if __name__ == "__main__":
    main()
