"""What quantized weights change in the embedded model's output: greedy completions of the int8
and int4 backends against the float32 one on held-out prompts (MATH-500 problems).

    python benchmarks/embedded_quality.py [--problems 40] [--max-tokens 384] \
        [--schemes int8,int4]

The first `--problems` problems of MATH-500 (../shared/data/math500_test.json), none of which
the demo trains on, as chats asking for a boxed answer; both backends decode greedily in the
same batches of 8. Per problem and scheme:
- whether the two completions are identical, and how far they agree token by token before the
  first difference (as a fraction of the float32 completion);
- teacher-forced agreement: the float32 completion fed to both models, the share of its
  positions where the quantized model's top token is the float32 model's, and the mean
  KL(float32 ‖ quantized) of the next-token distributions there (a measure that a first
  difference does not cascade into);
- answers: the boxed answer of each (rstar_pipelines.math.answers), whether they agree
  (math-verify equivalence, or both without one), and each against the reference.
Prints Markdown for docs/benchmarks.md. Not a test: figures depend on the sample.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from rstar_kernels.quality import kl_and_agreement
from rstar_pipelines.llm import SamplingParams, torch_thread
from rstar_pipelines.llm.cpu.backend import CpuTransformersLLM
from rstar_pipelines.llm.cpu.decode_loop import common_prefix_length
from rstar_pipelines.math.answers import equivalent, extract_boxed
from rstar_sandbox.bench import machine
from tests.fakes.repo import SHARED_DATA

MATH500 = SHARED_DATA / "math500_test.json"  # read where it lives, never copied
ASK = "Solve the problem. Put the final answer in \\boxed{{}}.\n\n{}"


@torch.inference_mode()
def teacher_forced(fp32: CpuTransformersLLM, other: CpuTransformersLLM, prompt_ids, completion_ids):
    """(mean KL, top-1 agreement) over the completion's positions, one forward of each model."""
    ids = torch.tensor([prompt_ids + completion_ids])
    span = slice(len(prompt_ids) - 1, ids.shape[1] - 1)
    return kl_and_agreement(
        fp32._model(input_ids=ids).logits[0, span], other._model(input_ids=ids).logits[0, span]
    )


def same_answer(a: str | None, b: str | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return equivalent(a, b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=384)
    parser.add_argument("--schemes", default="int8,int4", help="quantizations, comma-separated")
    args = parser.parse_args()
    schemes = args.schemes.split(",")
    problems = json.loads(MATH500.read_text())[: args.problems]
    chats = [[{"role": "user", "content": ASK.format(p["question"])}] for p in problems]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    llms = {
        q: CpuTransformersLLM("embedded", batch_size=8, quantization=q) for q in ["none", *schemes]
    }
    outputs, seconds = {}, {}
    for quantization, llm in llms.items():
        start = time.perf_counter()
        outputs[quantization] = [samples[0] for samples in llm.generate(chats, params)]
        seconds[quantization] = time.perf_counter() - start
    tokenizer = llms["none"]._tokenizer
    rows: dict[str, list[dict]] = {q: [] for q in schemes}
    fp32_boxed, fp32_correct = [], []
    for i, (chat, problem) in enumerate(zip(chats, problems, strict=True)):
        fp32 = outputs["none"][i]
        reference = tokenizer(fp32.text, add_special_tokens=False)["input_ids"]
        prompt_ids = llms["none"]._encode(i, chat)
        fp32_answer = extract_boxed(fp32.text)
        fp32_boxed.append(fp32_answer is not None)
        fp32_correct.append(fp32_answer is not None and equivalent(fp32_answer, problem["answer"]))
        for q in schemes:
            other = outputs[q][i]
            quantized = tokenizer(other.text, add_special_tokens=False)["input_ids"]
            # On the thread the models were loaded on and generate on (module `llm.torch_thread`).
            kl, agree = torch_thread.run(
                teacher_forced, llms["none"], llms[q], prompt_ids, reference
            )
            answer = extract_boxed(other.text)
            rows[q].append(
                {
                    "identical": fp32.text == other.text,
                    "prefix": common_prefix_length(reference, quantized) / max(len(reference), 1),
                    "top1": agree,
                    "kl": kl,
                    "same_answer": same_answer(fp32_answer, answer),
                    "correct": answer is not None and equivalent(answer, problem["answer"]),
                    "boxed": answer is not None,
                }
            )
    tokens = {q: sum(c.completion_tokens for c in out) for q, out in outputs.items()}
    count = len(problems)

    def share(q: str, key: str) -> str:
        return f"{sum(r[key] for r in rows[q])}/{count}"

    def mean(q: str, key: str) -> str:
        return f"{statistics.mean(r[key] for r in rows[q]):.4f}"

    def line(measure: str, cell) -> None:
        print(f"| {measure} | " + " | ".join(cell(q) for q in schemes) + " |")

    print(f"machine: {machine()}, torch {torch.__version__}")
    print(f"MATH-500 problems 0-{count - 1}, greedy, max_tokens {args.max_tokens}")
    print(
        "generation: " + ", ".join(f"{q} {tokens[q]} tokens in {seconds[q]:.0f} s" for q in outputs)
    )
    print(
        f"float32: {sum(fp32_boxed)}/{count} boxed answers, {sum(fp32_correct)}/{count} correct\n"
    )
    print("| against float32 | " + " | ".join(schemes) + " |")
    print("| --- |" + " --- |" * len(schemes))
    line("identical completions", lambda q: share(q, "identical"))
    line("tokens agreeing before the first difference (mean share)", lambda q: mean(q, "prefix"))
    line("teacher-forced top-1 agreement (mean)", lambda q: mean(q, "top1"))
    line("teacher-forced KL(float32 ‖ scheme) per token (mean)", lambda q: mean(q, "kl"))
    line("same boxed answer (or both none)", lambda q: share(q, "same_answer"))
    line("boxed answers", lambda q: share(q, "boxed"))
    line("correct", lambda q: share(q, "correct"))


if __name__ == "__main__":
    main()
