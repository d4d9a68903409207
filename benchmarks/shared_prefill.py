"""Sampling n completions per prompt with the transformers backend: one shared prefill per
prompt against generate()'s own copying (every copy prefilled), on the embedded model.

    python benchmarks/shared_prefill.py [--rounds 3] [--n 4] [--max-tokens 64]

Four few-shot prompts of ~800-900 tokens (the MCTS bootstrap prompt over demo problems) in
one left-padded batch; both ways alternate on one loaded model, median seconds per call.
Prints Markdown for docs/benchmarks.md. Not a test: figures depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from rstar_pipelines.llm import SamplingParams
from rstar_pipelines.llm.cpu.backend import CpuTransformersLLM
from rstar_pipelines.pipeline.prompts import PromptTemplate
from rstar_sandbox.bench import machine

REPO = Path(__file__).resolve().parent.parent


def prompts(count: int) -> list[str]:
    template = PromptTemplate.load(REPO / "assets" / "prompts", "mcts_bootstrap.jinja")
    seeds = (REPO / "assets" / "seeds" / "demo" / "demo.jsonl").read_text().splitlines()
    problems = [json.loads(line) for line in seeds if '"math"' in line]
    # Longer problems last: the prompts differ in length, so the batch is left-padded.
    problems = sorted(problems, key=lambda p: len(p["problem"]))[-count:]
    return [template.render(question=p["problem"]) for p in problems]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(2)
    llm = CpuTransformersLLM("embedded")
    batch = prompts(4)
    params = SamplingParams(n=args.n, temperature=0.7, max_tokens=args.max_tokens, seed=0)
    shared = llm._shared_prefill
    ways = {
        "one prefill per prompt, cache copied n times": shared,
        "generate() copies each prompt n times": lambda *_: None,
    }
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    tokens: dict[str, int] = {}
    for _ in range(args.rounds):
        for name, prefill in ways.items():
            llm._shared_prefill = prefill
            start = time.perf_counter()
            out = llm.generate(batch, params)
            seconds[name].append(time.perf_counter() - start)
            tokens[name] = sum(c.completion_tokens for row in out for c in row)
    lengths = [len(llm._tokenizer(p)["input_ids"]) for p in batch]
    print(f"machine: {machine()}")
    print(f"prompts: {lengths} tokens, n={args.n}, max_tokens={args.max_tokens}\n")
    print("| prefill | seconds per call (median) | all rounds | generated tokens |")
    print("| --- | --- | --- | --- |")
    for name, times in seconds.items():
        rounds = " / ".join(f"{t:.1f}" for t in times)
        print(f"| {name} | {statistics.median(times):.1f} | {rounds} | {tokens[name]} |")


if __name__ == "__main__":
    main()
