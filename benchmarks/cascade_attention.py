"""Cascade attention (module `llm.cpu.cascade_attention`) against SDPA over every row's own copy of
its prompt, on the embedded model as the demo loads it (int4), over the demo's call shapes.

    python benchmarks/cascade_attention.py [--rounds 2]

Workloads, each one `generate()` call of n samples per prompt: MCTS expansions (the search's
few-shot bootstrap prompts over demo math problems, about 800 tokens, 4 samples, 64 new tokens;
1 and 2 prompts), a synthesis-like call (8 such prompts x 2 samples, 128 new tokens) and a
`candidate_solutions` call (16 demo word problems as chats x 3 samples, 128 new tokens). One
loaded model runs every workload both ways, alternating, its attention switched between the two
(`set_attn_implementation`); no prefix is kept between calls. The samples can differ between
the two ways (bfloat16 activations round the merged attention differently), so the measure is
milliseconds per generated token, prefill included. Prints Markdown for docs/benchmarks.md. Not
a test: figures depend on the machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.embedded_generation import chats, load_average
from benchmarks.shared_prefill import prompts as bootstrap_prompts
from rstar_pipelines.llm import SamplingParams
from rstar_pipelines.llm.cpu.backend import CpuTransformersLLM
from rstar_pipelines.llm.cpu.cascade_attention import ATTENTION_NAME
from rstar_sandbox.bench import machine

WAYS = {"cascade": ATTENTION_NAME, "SDPA, a copy per row": "sdpa"}


def workloads() -> list[tuple[str, list, SamplingParams]]:
    def sampled(n: int, max_tokens: int) -> SamplingParams:
        return SamplingParams(n=n, temperature=0.8, top_p=0.95, max_tokens=max_tokens, seed=0)

    return [
        ("1 prompt x 4 samples (an MCTS expansion)", bootstrap_prompts(1), sampled(4, 64)),
        ("2 prompts x 4 samples (MCTS expansions)", bootstrap_prompts(2), sampled(4, 64)),
        ("8 prompts x 2 samples (synthesis-like)", bootstrap_prompts(8), sampled(2, 128)),
        ("16 prompts x 3 samples (candidate_solutions)", chats(16, offset=8), sampled(3, 128)),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(2)
    llm = CpuTransformersLLM("embedded")
    llm.prefix_cache = None
    model = llm._model
    before = load_average()
    rows = []
    try:
        for name, prompts, params in workloads():
            per_token: dict[str, list[float]] = {way: [] for way in WAYS}
            for _ in range(args.rounds):
                for way, implementation in WAYS.items():
                    model.set_attn_implementation(implementation)
                    start = time.perf_counter()
                    results = llm.generate(prompts, params)
                    seconds = time.perf_counter() - start
                    tokens = sum(c.completion_tokens for samples in results for c in samples)
                    per_token[way].append(1000 * seconds / tokens)
            rows.append((name, per_token))
    finally:
        model.set_attn_implementation(ATTENTION_NAME)
    print(f"machine: {machine()}")
    print(f"load average before: {before}; after: {load_average()}; rounds: {args.rounds}\n")
    print("| workload | " + " | ".join(f"{way}: ms per token" for way in WAYS) + " | ratio |")
    print("| --- | " + " | ".join("---" for _ in WAYS) + " | --- |")
    for name, per_token in rows:
        cells = [" / ".join(f"{t:.1f}" for t in times) for times in per_token.values()]
        cascade, sdpa = (statistics.median(times) for times in per_token.values())
        print(f"| {name} | {' | '.join(cells)} | {cascade / sdpa:.2f} |")


if __name__ == "__main__":
    main()
