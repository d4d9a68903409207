"""Generation speed of the embedded model on the CPU: float32 against int8 and int4 weights
through the transformers backend, and the backend against a bare decode loop over the same
weights.

    python benchmarks/embedded_generation.py [--rounds 3] [--max-tokens 128] \
        [--schemes none,int8,int4]

Seven workloads, each one `generate()` call: 1 and 16 sequences, greedy and sampled (temperature
0.8, top_p 0.95, seed 0), and the demo's shapes: `candidate_solutions` calls of 8 and 16 problems
with 3 samples each, and an MCTS expansion (1 prompt, 4 samples).
The 16 greedy sequences are 16 demo math problems in one left-padded batch; the 16 sampled ones
are n=16 samples of one problem (one shared prefill). Prompts are
chats asking for a boxed answer; the stop string "<end_of_answer>" (the MCTS steps' own) is
checked every step and rarely fires. Tokens/s is generated tokens (`completion_tokens`) over the
call's wall time, prefill included.

The bare loop does what a call without early exits would do and nothing else: the same rows,
prefilled once (a sampled prompt once, then its cache repeated per sample), then every row for
as many steps as the call's longest completion (the backend drops rows as they end), each a
forward over the same preallocated cache and an argmax or a temperature/top-p draw; no stop
checks or logits processors. Its tokens/s counts the backend's generated tokens over its own
time, so the ratio is backend time against bare time for the same completions.

Every round runs every (workload, system) once, in the same order; the table gives the median
over rounds and the range. The machine is shared: the script prints the load average before
and after. Prints Markdown for docs/benchmarks.md. Not a test: figures depend on the machine.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from rstar_kernels.hf import cache_argument
from rstar_pipelines.llm import SamplingParams, torch_thread
from rstar_pipelines.llm.cpu.backend import CpuTransformersLLM
from rstar_pipelines.llm.cpu.kv_cache import preallocated_cache
from rstar_sandbox.bench import machine

REPO = Path(__file__).resolve().parent.parent
STOP = ("<end_of_answer>",)


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: int
    samples: int  # per prompt; 0: greedy
    offset: int = 0  # the first demo math problem used


WORKLOADS = (
    Workload("1 sequence, greedy", 1, 0),
    Workload("16 sequences, greedy", 16, 0),
    Workload("1 sequence, sampled", 1, 1),
    Workload("16 sequences, sampled", 1, 16),
    # Past the one-line arithmetic seeds, as the demo's stages meet the word problems.
    Workload("8 prompts x 3 samples (candidate_solutions)", 8, 3, offset=8),
    # The demo's own shapes: a search expansion, and a full candidate_solutions batch.
    Workload("1 prompt x 4 samples (an MCTS expansion)", 1, 4, offset=8),
    Workload("16 prompts x 3 samples (candidate_solutions)", 16, 3, offset=8),
)


def chats(count: int, offset: int = 0) -> list[list[dict[str, str]]]:
    seeds = (REPO / "assets" / "seeds" / "demo" / "demo.jsonl").read_text().splitlines()
    problems = [json.loads(line)["problem"] for line in seeds if '"math"' in line]
    problems = problems[offset : offset + count]
    ask = "Solve the problem. Put the final answer in \\boxed{{}}.\n\n{}"
    return [[{"role": "user", "content": ask.format(p)}] for p in problems]


def request(workload: Workload, max_tokens: int) -> tuple[list, SamplingParams]:
    prompts = chats(workload.prompts, workload.offset)
    if workload.samples:
        params = SamplingParams(
            n=workload.samples, temperature=0.8, top_p=0.95, max_tokens=max_tokens, seed=0
        )
        return prompts, params.model_copy(update={"stop": STOP})
    return prompts, SamplingParams(temperature=0, max_tokens=max_tokens, stop=STOP)


def run_backend(llm: CpuTransformersLLM, prompts: list, params: SamplingParams):
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = [c.completion_tokens for samples in results for c in samples]
    return seconds, sum(tokens), max(tokens)


def _pick(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    if params.temperature == 0:
        return logits.argmax(-1, keepdim=True)
    probs = (logits / params.temperature).softmax(-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(-1, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs > params.top_p
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(outside, 0.0))
    return torch.multinomial(probs, 1)


@torch.inference_mode()
def run_bare(llm: CpuTransformersLLM, prompts: list, params: SamplingParams, steps: int) -> float:
    """Seconds for the bare loop over `llm`'s model: `steps` tokens for every row."""
    model, pad = llm._model, llm._pad_id
    rows = [llm._encode(i, prompt) for i, prompt in enumerate(prompts)]
    width = max(len(ids) for ids in rows)
    start = time.perf_counter()
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = preallocated_cache(model.config, width + steps)
    logits = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        **cache_argument(model, cache),
        use_cache=True,
    ).logits[:, -1]
    copies = params.n if params.temperature > 0 else 1
    if copies > 1:
        cache.batch_repeat_interleave(copies)
        logits = logits.repeat_interleave(copies, dim=0)
        mask = mask.repeat_interleave(copies, dim=0)
        positions = positions.repeat_interleave(copies, dim=0)
    position = positions[:, -1:]
    for _ in range(steps - 1):
        token = _pick(logits, params)
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=-1)
        position = position + 1
        logits = model(
            input_ids=token,
            attention_mask=mask,
            position_ids=position,
            **cache_argument(model, cache),
            use_cache=True,
        ).logits[:, -1]
    _pick(logits, params)
    return time.perf_counter() - start


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--schemes", default="none,int8,int4", help="quantizations, comma-separated"
    )
    args = parser.parse_args()
    schemes = args.schemes.split(",")
    load_before = load_average()
    loading = {}
    systems = {}
    for quantization in schemes:
        start = time.perf_counter()
        systems[quantization] = CpuTransformersLLM(
            "embedded", batch_size=16, device="cpu", quantization=quantization
        )
        loading[quantization] = time.perf_counter() - start
    names = {q: f"backend, {'float32' if q == 'none' else q}" for q in schemes}
    rates: dict[tuple[str, str], list[float]] = {}
    ratios: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for workload in WORKLOADS:
            prompts, params = request(workload, args.max_tokens)
            for quantization, llm in systems.items():
                seconds, tokens, steps = run_backend(llm, prompts, params)
                # On the thread the backend's model runs on (module `llm.torch_thread`).
                bare = torch_thread.run(run_bare, llm, prompts, params, steps)
                rates.setdefault((workload.name, names[quantization]), []).append(tokens / seconds)
                bare_name = f"bare loop, {names[quantization].split(', ')[1]}"
                rates.setdefault((workload.name, bare_name), []).append(tokens / bare)
                ratios.setdefault((workload.name, names[quantization]), []).append(bare / seconds)
    print(f"machine: {machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"load average before: {load_before}; after: {load_average()}")
    print("model load: " + ", ".join(f"{q} {s:.1f} s" for q, s in loading.items()))
    print(f"rounds: {args.rounds}, max_tokens {args.max_tokens}\n")
    print("| workload | system | tokens/s (median) | range | backend / bare loop |")
    print("| --- | --- | --- | --- | --- |")
    for (workload, system), values in rates.items():
        ratio = ratios.get((workload, system))
        shown = f"{statistics.median(ratio):.2f}" if ratio else ""
        print(
            f"| {workload} | {system} | {statistics.median(values):.1f} | "
            f"{min(values):.1f}-{max(values):.1f} | {shown} |"
        )
    for workload in WORKLOADS:
        median = {q: statistics.median(rates[(workload.name, names[q])]) for q in schemes}
        shown = ", ".join(
            f"{names[a].split(', ')[1]} / {names[b].split(', ')[1]} = {median[a] / median[b]:.2f}"
            for b, a in itertools.combinations(schemes, 2)  # each scheme over the earlier ones
        )
        print(f"\n{workload.name}: {shown}", end="")
    print()


if __name__ == "__main__":
    main()
