"""Prompt prefixes kept between generate() calls (module `llm.cpu.prefix_cache`) against none, on
the embedded model, over the calls of one MCTS tree path.

    python benchmarks/prefix_cache.py [--rounds 3] [--depth 6] [--n 4] [--max-tokens 64]

A path as the search walks it, `--depth` calls: the bootstrap prompt over the longest demo math
problem, then each prompt the last one plus the step the model wrote (its first sample); every
call samples `n` next steps. The prompts are made once; both ways then replay them on one
loaded model, alternating, the store emptied before each replay. Prints Markdown for
docs/benchmarks.md. Not a test: figures depend on the machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.shared_prefill import prompts as bootstrap_prompts
from rstar_pipelines.llm import SamplingParams
from rstar_pipelines.llm.cpu.backend import CpuTransformersLLM
from rstar_sandbox.bench import machine


def path_prompts(llm: CpuTransformersLLM, depth: int, params: SamplingParams) -> list[str]:
    prompt = bootstrap_prompts(1)[0]
    path = [prompt]
    for _ in range(depth - 1):
        prompt += llm.generate([prompt], params)[0][0].text
        path.append(prompt)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(2)
    llm = CpuTransformersLLM("embedded")
    store = llm.prefix_cache
    params = SamplingParams(n=args.n, temperature=0.7, max_tokens=args.max_tokens, seed=0)
    path = path_prompts(llm, args.depth, params)
    seconds: dict[str, list[float]] = {"prefixes kept": [], "none kept": []}
    for _ in range(args.rounds):
        for name in seconds:
            store.clear()
            llm.prefix_cache = store if name == "prefixes kept" else None
            reused, computed = store.reused_tokens, store.computed_tokens
            start = time.perf_counter()
            for prompt in path:
                llm.generate([prompt], params)
            seconds[name].append(time.perf_counter() - start)
            if name == "prefixes kept":
                counts = store.reused_tokens - reused, store.computed_tokens - computed
    lengths = [len(llm._tokenizer(p)["input_ids"]) for p in path]
    print(f"machine: {machine()}")
    print(
        f"path: {len(path)} calls, prompts of {lengths} tokens, n={args.n}, "
        f"max_tokens={args.max_tokens}"
    )
    print(f"prefix tokens with the store: {counts[0]} reused, {counts[1]} computed\n")
    print("| prefixes | seconds per path (median) | all rounds | seconds per call |")
    print("| --- | --- | --- | --- |")
    for name, times in seconds.items():
        rounds = " / ".join(f"{t:.1f}" for t in times)
        median = statistics.median(times)
        print(f"| {name} | {median:.1f} | {rounds} | {median / len(path):.2f} |")


if __name__ == "__main__":
    main()
